"""Label-smoothed cross entropy: torch's numbers, padding ignored and padding-amount invariant."""

import pytest
import torch
import torch.nn.functional as F

from transformer.losses import label_smoothed_cross_entropy, symmetric_kl

PAD = 0


def _batch(B: int = 3, T: int = 7, V: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(B, T, V, dtype=torch.float64)
    target = torch.randint(1, V, (B, T))
    target[0, 4:] = PAD  # ragged lengths
    target[2, 2:] = PAD
    return logits, target


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_matches_torch_cross_entropy(eps: float) -> None:
    logits, target = _batch()
    out = label_smoothed_cross_entropy(logits, target, ignore_index=PAD, label_smoothing=eps)
    V = logits.size(-1)
    expected = F.cross_entropy(logits.view(-1, V), target.view(-1), ignore_index=PAD, label_smoothing=eps)
    torch.testing.assert_close(out.loss, expected)
    nll = F.cross_entropy(logits.view(-1, V), target.view(-1), ignore_index=PAD)
    torch.testing.assert_close(out.nll, nll)
    assert out.n_tokens.item() == (target != PAD).sum().item()


def test_gradients_match_torch() -> None:
    logits, target = _batch()
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    label_smoothed_cross_entropy(ours, target, label_smoothing=0.1).loss.backward()
    F.cross_entropy(theirs.view(-1, 11), target.view(-1), ignore_index=PAD, label_smoothing=0.1).backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7)
    assert torch.all(ours.grad[target == PAD] == 0)


def test_extra_pad_columns_and_rows_change_nothing() -> None:
    logits, target = _batch()
    base = label_smoothed_cross_entropy(logits, target, label_smoothing=0.1)
    B, T, V = logits.shape
    padded_logits = torch.cat([logits, torch.randn(B, 5, V, dtype=logits.dtype)], dim=1)  # (B, T+5, V)
    padded_target = torch.cat([target, torch.full((B, 5), PAD)], dim=1)
    padded_logits = torch.cat([padded_logits, torch.randn(2, T + 5, V, dtype=logits.dtype)])  # 2 pad rows
    padded_target = torch.cat([padded_target, torch.full((2, T + 5), PAD)])
    more = label_smoothed_cross_entropy(padded_logits, padded_target, label_smoothing=0.1)
    for a, b in zip(base, more):
        torch.testing.assert_close(a, b)


def test_token_accuracy_counts_only_non_pad() -> None:
    target = torch.tensor([[3, 4, PAD], [5, PAD, PAD]])
    logits = torch.full((2, 3, 8), -5.0)
    logits[0, 0, 3] = logits[0, 1, 1] = logits[1, 0, 5] = 5.0  # right, wrong, right
    logits[0, 2, PAD] = logits[1, 1, PAD] = logits[1, 2, PAD] = 5.0  # "right" on pad: not counted
    out = label_smoothed_cross_entropy(logits, target)
    assert (out.n_correct.item(), out.n_tokens.item()) == (2, 3)


def test_all_pad_batch_is_zero_not_nan() -> None:
    out = label_smoothed_cross_entropy(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))
    assert out.loss.item() == 0.0 and out.nll.item() == 0.0 and out.n_tokens.item() == 0


def test_low_precision_logits_are_computed_in_float32() -> None:
    logits, target = _batch()
    out = label_smoothed_cross_entropy(logits.bfloat16(), target)
    assert out.loss.dtype == torch.float32
    ref = label_smoothed_cross_entropy(logits.bfloat16().double(), target)
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("eps", [-0.1, 1.0])
def test_bad_smoothing_is_refused(eps: float) -> None:
    with pytest.raises(ValueError, match="label_smoothing"):
        label_smoothed_cross_entropy(
            torch.randn(1, 2, 3), torch.ones(1, 2, dtype=torch.long), label_smoothing=eps
        )


def test_symmetric_kl_matches_torch_kl_div_both_ways() -> None:
    torch.manual_seed(0)
    p, q = torch.randn(6, 3, requires_grad=True), torch.randn(6, 3, requires_grad=True)
    log_p, log_q = F.log_softmax(p, dim=-1), F.log_softmax(q, dim=-1)
    kl_pq = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")  # KL(p || q)
    kl_qp = F.kl_div(log_p, log_q, log_target=True, reduction="batchmean")  # KL(q || p)
    expected = (kl_pq + kl_qp) / 2
    got = symmetric_kl(p, q)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got, [p, q]), torch.autograd.grad(expected, [p, q]))
    assert symmetric_kl(p, p).abs().item() < 1e-7  # identical predictions: no penalty
    torch.testing.assert_close(symmetric_kl(q, p), got)  # symmetric
    assert symmetric_kl(p.bfloat16(), q.bfloat16()).dtype == torch.float32
