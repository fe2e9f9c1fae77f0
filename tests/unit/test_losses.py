"""Label-smoothed cross entropy: torch's numbers, padding ignored and padding-amount invariant, in float32 and
bfloat16, chunked or not; no float32 copy of the logits kept for backward; one compiled graph for any N."""

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from transformer import losses
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


# --- bfloat16 logits, chunking, memory and compilation -------------------------------------------------


@pytest.fixture(params=["one piece", "chunked"])
def chunking(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a test with the loss in one piece and in chunks of 3 rows of 11 (the last one shorter)."""
    if request.param == "chunked":
        monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 33)
    yield request.param


def _reference(logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Loss and NLL written with torch's ops, through autograd, in float32 (or wider)."""
    V = logits.size(-1)
    flat, gold = (
        logits.reshape(-1, V).to(torch.promote_types(logits.dtype, torch.float32)),
        target.reshape(-1),
    )
    loss = F.cross_entropy(flat, gold, ignore_index=PAD, label_smoothing=eps)
    lprobs = F.log_softmax(flat, dim=-1)  # (N, V)
    keep = gold != PAD
    nll = -(lprobs.gather(-1, gold.unsqueeze(-1)).squeeze(-1) * keep).sum() / keep.sum()
    return loss, nll


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_nll_and_gradients_match_autograd_reference(chunking: str, dtype: torch.dtype) -> None:
    """g_loss * loss + g_nll * nll: both outputs carry gradient; pad rows get exactly zero."""
    torch.manual_seed(0)
    logits, target = _batch()
    logits = (3 * logits).to(dtype)
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    out = label_smoothed_cross_entropy(ours, target, label_smoothing=0.1)
    loss, nll = _reference(theirs, target, 0.1)
    assert out.loss.dtype == out.nll.dtype == torch.float32
    torch.testing.assert_close(out.loss, loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.nll, nll, rtol=1e-6, atol=1e-6)
    (0.7 * out.loss + 0.3 * out.nll).backward()
    (0.7 * loss + 0.3 * nll).backward()
    assert ours.grad.dtype == dtype
    # float32: the same numbers; bfloat16: the float32 gradient, rounded once
    torch.testing.assert_close(
        ours.grad, theirs.grad, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-7
    )
    assert torch.all(ours.grad[target == PAD] == 0)


def test_chunks_change_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, target = _batch()
    results = []
    for chunk in (1 << 24, 33, 11):  # one piece; 3 rows at a time; 1 row at a time
        monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", chunk)
        x = logits.float().requires_grad_()
        out = label_smoothed_cross_entropy(x, target)
        (out.loss + out.nll).backward()
        results.append((*out, x.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_exact_tie_with_the_gold_token_counts_as_correct(chunking: str, dtype: torch.dtype) -> None:
    target = torch.tensor([[3, 4, 5, 6], [7, 8, PAD, PAD]])  # (2, 4), V = 11
    logits = torch.zeros(2, 4, 11, dtype=dtype)
    logits[0, 0, 3] = 2.0  # gold is the unique max: correct
    logits[0, 1, 4] = logits[0, 1, 9] = 2.0  # gold ties the max: correct
    logits[0, 2, 5], logits[0, 2, 1] = 2.0, 2.015625  # gold one bfloat16 ulp below the max: wrong
    logits[0, 3, 6], logits[0, 3, 1] = 1.0, 2.0  # wrong
    logits[1, 0, 7] = logits[1, 0, 2] = 5.0  # tie: correct
    logits[1, 1, 8] = -1.0  # all others 0 > gold: wrong
    logits[1, 2:, PAD] = 9.0  # pad rows: "right", but not counted
    out = label_smoothed_cross_entropy(logits, target)
    assert (out.n_correct.item(), out.n_tokens.item()) == (3, 6)


def _saved(logits: Tensor, target: Tensor) -> list[Tensor]:
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        label_smoothed_cross_entropy(logits, target)
    return saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_keeps_only_the_logits_themselves(dtype: torch.dtype) -> None:
    """No float32 (N, V) tensor lives from forward to backward: only the logits (which exist anyway) and
    per-token vectors are saved."""
    logits, target = _batch(B=4, T=8, V=50)
    logits = logits.to(dtype).requires_grad_()
    N = target.numel()
    for tensor in _saved(logits, target):
        if tensor.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
            assert tensor.numel() <= N, (tensor.shape, tensor.dtype)


def _peak_allocated(fn: object) -> int:
    """Peak CPU bytes allocated while `fn()` runs, above what was allocated before (profiler events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()  # type: ignore[operator]
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            events.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
    events.sort()
    return max(total for _, _, total in events) - (events[0][2] - events[0][1])


def test_float32_temporaries_are_bounded_by_the_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 logits (N, V): forward + backward allocate the bfloat16 gradient and a few float32 chunks,
    not the two float32 (N, V) buffers (log-probabilities, softmax) of a one-piece computation."""
    N, V, chunk = 512, 1000, 32 * 1000
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", chunk)
    logits = torch.randn(N, V).to(torch.bfloat16).requires_grad_()
    target = torch.randint(1, V, (N,))
    peak = _peak_allocated(lambda: label_smoothed_cross_entropy(logits, target).loss.backward())
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    # the gradient, up to 3 float32 chunks alive at once (upcast input, output, its copy), vectors (N,)
    assert peak <= N * V * 2 + 3 * chunk * 4 + 64 * N, peak
    assert peak < N * V * 4  # less than one float32 copy of the logits


def test_compiles_to_one_graph_whatever_the_number_of_tokens() -> None:
    """torch.compile(fullgraph=True) traces forward and backward once for a dynamic N (no chunk loop
    specializes it) and gives eager's numbers."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        out = label_smoothed_cross_entropy(logits, target, label_smoothing=0.1)
        return out.loss, out.nll, out.n_correct

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    try:
        for T in (7, 9, 13):
            logits, target = _batch(T=T)
            ours, theirs = logits.float().requires_grad_(), logits.float().requires_grad_()
            got, expected = compiled(ours, target), step(theirs, target)
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b)
            (got[0] + got[1]).backward()
            (expected[0] + expected[1]).backward()
            torch.testing.assert_close(ours.grad, theirs.grad)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ignore_index", [PAD, 5])
def test_padding_and_all_pad_rows_in_low_precision(
    chunking: str, dtype: torch.dtype, ignore_index: int
) -> None:
    """16-bit logits with ignored positions (a whole sentence of them too, and an ignore_index that is a
    real vocabulary entry): loss, NLL and the gradient are F.cross_entropy's through autograd in float32,
    the gradient rounded once to the logits' dtype; ignored rows get exactly zero."""
    torch.manual_seed(1)
    logits, target = _batch(B=4)
    target[target == PAD] = ignore_index
    target[3] = ignore_index  # a sentence that is all padding
    logits = (3 * logits).to(dtype)
    ours, theirs = logits.clone().requires_grad_(), logits.float().requires_grad_()
    out = label_smoothed_cross_entropy(ours, target, ignore_index=ignore_index, label_smoothing=0.1)
    flat = theirs.reshape(-1, 11)
    loss = F.cross_entropy(flat, target.reshape(-1), ignore_index=ignore_index, label_smoothing=0.1)
    nll = F.cross_entropy(flat, target.reshape(-1), ignore_index=ignore_index)
    torch.testing.assert_close(out.loss, loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.nll, nll, rtol=1e-6, atol=1e-6)
    (out.loss + 0.5 * out.nll).backward()
    (loss + 0.5 * nll).backward()
    assert ours.grad.dtype == dtype
    exact = theirs.grad  # float32: ours is it rounded once, at most half an ulp of the dtype away
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-23}[dtype]
    assert ((ours.grad.float() - exact).abs() <= ulp * exact.abs() + 1e-7).all()
    assert torch.all(ours.grad[target == ignore_index] == 0)


def test_all_pad_batch_in_bfloat16_has_zero_gradient(chunking: str) -> None:
    logits = torch.randn(2, 3, 11).bfloat16().requires_grad_()
    out = label_smoothed_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long))
    (out.loss + out.nll).backward()
    assert out.loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits.grad))


def test_chunk_size_is_chosen_by_device() -> None:
    """CPU: 16M-element chunks (one piece below); CUDA: 64M-element chunks (fewer launches, measured)."""
    V = 32_000
    assert losses._row_chunks(500, V, torch.device("cpu")) == [slice(None)]
    assert losses._row_chunks(2000, V, torch.device("cuda")) == [slice(None)]  # 64M elements: one piece
    on_gpu = losses._row_chunks(28_000, V, torch.device("cuda"))
    rows = (1 << 26) // V
    assert on_gpu[0] == slice(0, rows) and len(on_gpu) == -(-28_000 // rows) == 14
    assert len(losses._row_chunks(2000, V, torch.device("cpu"))) == -(-2000 // ((1 << 24) // V))


@pytest.mark.parametrize("which", ["loss", "nll"])
def test_either_output_alone_carries_the_gradient(chunking: str, which: str) -> None:
    """The other output's gradient is not materialized (None in backward): still the reference gradient."""
    logits, target = _batch()
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    getattr(label_smoothed_cross_entropy(ours, target, label_smoothing=0.1), which).backward()
    loss, nll = _reference(theirs, target, 0.1)
    (loss if which == "loss" else nll).backward()
    torch.testing.assert_close(ours.grad, theirs.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_addcmul_gradient_write_matches_torch(
    chunking: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA branch of the gradient write (one addcmul that scales, shifts and casts each chunk), run on
    the CPU: loss and gradient equal `F.cross_entropy(label_smoothing=, ignore_index=)`'s, within float32
    rounding; bf16 logits get the float32 gradient rounded once (bf16 has an 8-bit mantissa: 2 ** -8 ~ 4e-3
    relative), pad rows exactly zero."""
    monkeypatch.setattr(losses, "_ONE_KERNEL_GRAD_WRITE", frozenset({"cpu", "cuda"}))
    torch.manual_seed(1)
    logits, target = _batch(B=4, T=9, V=13)
    logits = (3 * logits).to(dtype)
    ours, theirs = logits.clone().requires_grad_(), logits.clone().float().requires_grad_()
    out = label_smoothed_cross_entropy(ours, target, label_smoothing=0.1)
    expected = F.cross_entropy(theirs.view(-1, 13), target.view(-1), ignore_index=PAD, label_smoothing=0.1)
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    expected.backward()
    assert ours.grad.dtype == dtype
    tolerance = {"rtol": 1e-6, "atol": 1e-8} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-6}
    torch.testing.assert_close(ours.grad.float(), theirs.grad.to(dtype).float(), **tolerance)
    assert torch.all(ours.grad[target == PAD] == 0)


# --- the output projection and the loss fused (linear_label_smoothed_cross_entropy) ----------------------


def _projection_case(
    bias: bool, shape: tuple[int, ...] = (5, 11)
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """hidden (*shape, 16), weight (97, 16), bias (97,) or None, target (*shape) with pads (0)."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(*shape, 16, generator=generator, requires_grad=True)
    weight = torch.randn(97, 16, generator=generator).mul_(0.5).requires_grad_()
    bias_ = torch.randn(97, generator=generator).requires_grad_() if bias else None
    target = torch.randint(1, 97, shape, generator=generator)
    target.view(-1)[::4] = 0
    return hidden, weight, bias_, target


def _loss_and_grads(fn, hidden, weight, bias, target, eps: float):
    for tensor in (hidden, weight, bias):
        if tensor is not None:
            tensor.grad = None
    out = fn(hidden, weight, bias, target, eps)
    (out.loss * 3.0).backward()  # a factor from outside: the stored gradients are scaled by it
    grads = [None if t is None else t.grad.clone() for t in (hidden, weight, bias)]
    return out, grads


def _unfused(hidden, weight, bias, target, eps):
    return label_smoothed_cross_entropy(F.linear(hidden, weight, bias), target, label_smoothing=eps)


def _fused(hidden, weight, bias, target, eps):
    return losses.linear_label_smoothed_cross_entropy(hidden, weight, bias, target, label_smoothing=eps)


@pytest.mark.parametrize("chunking", ["one-piece", "chunked"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_fused_projection_and_loss_equal_the_unfused(
    monkeypatch, chunking: str, bias: bool, eps: float
) -> None:
    """float32: loss, NLL and accuracy as the projection followed by the loss, and the gradients of hidden,
    weight and bias within 1e-6 relative, in one piece and in 3-row chunks."""
    if chunking == "chunked":
        monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 3 * 97)
    case = _projection_case(bias)
    reference, expected = _loss_and_grads(_unfused, *case, eps)
    out, grads = _loss_and_grads(_fused, *case, eps)
    torch.testing.assert_close(out.loss, reference.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.nll, reference.nll, rtol=1e-6, atol=0)
    assert (out.n_correct, out.n_tokens) == (reference.n_correct, reference.n_tokens)
    assert not out.nll.requires_grad  # reported, not differentiated
    for got, want in zip(grads, expected):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_the_fused_loss_under_bf16_autocast_is_close_to_the_unfused() -> None:
    """Under autocast the projection runs in bf16 (as F.linear would) and the softmax in float32: the loss
    within 1e-2 relative of the unfused bf16 path's, gradients within bf16 rounding of the products."""
    case = _projection_case(True, shape=(4, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference, expected = _loss_and_grads(_unfused, *case, 0.1)
        out, grads = _loss_and_grads(_fused, *case, 0.1)
    torch.testing.assert_close(out.loss, reference.loss.float(), rtol=1e-2, atol=0)
    for got, want in zip(grads, expected):
        assert got.dtype == want.dtype == torch.float32  # the parameters' own dtype
        torch.testing.assert_close(got, want, rtol=0.05, atol=2e-3)


def test_the_fused_loss_of_an_all_pad_batch_is_zero_not_nan() -> None:
    hidden, weight, bias, target = _projection_case(True)
    out, grads = _loss_and_grads(_fused, hidden, weight, bias, torch.zeros_like(target), 0.1)
    assert out.loss.item() == out.nll.item() == 0.0 and out.n_tokens.item() == 0
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_the_fused_loss_compiles_its_chunk_on_cuda_only(monkeypatch) -> None:
    monkeypatch.setattr(losses, "_has_triton", lambda: True)  # chosen by device type: no GPU needed
    assert losses._chunk_terms_on(torch.device("cpu")) is losses._chunk_terms
    compiled = losses._chunk_terms_on(torch.device("cuda"))
    assert compiled is not losses._chunk_terms and compiled is losses._chunk_terms_on(torch.device("cuda:1"))
    monkeypatch.setattr(losses, "_has_triton", lambda: False)  # Inductor has no GPU kernels without it
    assert losses._chunk_terms_on(torch.device("cuda")) is losses._chunk_terms


def test_the_compiled_chunk_gives_the_eager_numbers_in_one_graph(monkeypatch) -> None:
    """The compiled region CUDA takes (`_chunk_terms` through Inductor, run here on the CPU): one graph
    per dtype, with no graph break, for chunks of 7 rows and for every batch's last chunk and size (no
    recompile); loss, NLL, accuracy and the gradients of hidden, weight and bias as the eager chunk's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    monkeypatch.setattr(losses, "_COMPILED_CHUNK_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(losses, "_CHUNK_BACKEND", counter)
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 7 * 97)
    torch._dynamo.reset()
    try:
        for autocast in (False, True):  # float32 chunks, then bf16 ones (the GPU's)
            for shape in ((5, 11), (3, 6), (2, 9)):
                case = _projection_case(True, shape=shape)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out, grads = _loss_and_grads(_fused, *case, 0.1)
                    monkeypatch.setattr(losses, "_COMPILED_CHUNK_DEVICES", frozenset())
                    reference, expected = _loss_and_grads(_fused, *case, 0.1)
                    monkeypatch.setattr(losses, "_COMPILED_CHUNK_DEVICES", frozenset({"cpu"}))
                torch.testing.assert_close(out.loss, reference.loss, rtol=1e-6, atol=0)
                torch.testing.assert_close(out.nll, reference.nll, rtol=1e-6, atol=0)
                assert out.n_correct == reference.n_correct
                for got, want in zip(grads, expected, strict=True):
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 2  # one graph for float32 chunks, one for bf16
