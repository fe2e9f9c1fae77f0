"""MultiHeadAttention beyond what torch's module does: fully masked rows give zeros and finite gradients,
weights that sum to one, causal outputs blind to later positions, head-dim scaling, attention dropout, the
fast path's minimal masks, packed projections, and attention on packed tokens (no padding)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import transformer.attention as attention
import transformer.kernels as kernels
from tests.helpers.attention import E, H, bool_mask, pair_with_torch, rope
from transformer import MultiHeadAttention, make_causal_mask

# torch warns when key_padding_mask and attn_mask have different dtypes; mixing them is tested on purpose
pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched"),
    pytest.mark.usefixtures("one_thread"),
]


def test_sdpa_on_cpu_returns_zeros_for_fully_masked_rows() -> None:
    """The assumption behind `_SDPA_ZEROES_EMPTY_ROWS`: checked on the installed torch."""
    q = torch.randn(2, 2, 3, 4, requires_grad=True)
    k, v = (torch.randn(2, 2, 4, 4, requires_grad=True) for _ in range(2))
    attend = torch.ones(2, 1, 3, 4, dtype=torch.bool)
    attend[0, :, 1] = False
    out = F.scaled_dot_product_attention(q, k, v, attend)
    assert torch.equal(out[0, :, 1], torch.zeros(2, 4))
    out.sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))


@pytest.mark.parametrize("sdpa_zeroes_rows", [True, False], ids=["cpu-kernel", "manual-fixup"])
@pytest.mark.parametrize("mask_kind", ["kpm_bool", "kpm_float", "attn_bool", "attn_float3d", "both"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_rows_give_zeros_and_finite_grads(
    sdpa_zeroes_rows: bool, mask_kind: str, need_weights: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not sdpa_zeroes_rows:  # exercise the fix-up used on devices whose kernels return NaN
        monkeypatch.setattr(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset())
    ours, ref = pair_with_torch(batch_first=True)
    batch, q_len, k_len = 3, 4, 5
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(batch, q_len, E, generator=gen, requires_grad=True)
    memory = torch.randn(batch, k_len, E, generator=gen, requires_grad=True)
    kpm = torch.zeros(batch, k_len, dtype=torch.bool)
    kpm[1] = True  # every key of sentence 1 is padding: all its query rows are empty
    attn = torch.zeros(q_len, k_len, dtype=torch.bool)
    attn[2] = True  # query 2 may attend to nothing
    empty = torch.zeros(batch, q_len, dtype=torch.bool)
    call: dict = {}
    if mask_kind.startswith("kpm"):
        call["key_padding_mask"] = (
            kpm if mask_kind == "kpm_bool" else torch.zeros(kpm.shape).masked_fill(kpm, -math.inf)
        )
        empty[1] = True
    elif mask_kind == "attn_bool":
        call["attn_mask"] = attn
        empty[:, 2] = True
    elif mask_kind == "attn_float3d":
        per_head = torch.zeros(batch * H, q_len, k_len).masked_fill(attn, -math.inf)
        call["attn_mask"] = per_head
        empty[:, 2] = True
    else:
        call |= {"key_padding_mask": kpm, "attn_mask": attn}
        empty[1] = True
        empty[:, 2] = True

    out, weights = ours(query, memory, memory, need_weights=need_weights, average_attn_weights=False, **call)
    assert out.isfinite().all()
    # zero attention output: only the output projection's bias is left
    torch.testing.assert_close(out[empty], ours.out_proj.bias.expand(int(empty.sum()), E))
    if need_weights:
        assert torch.equal(weights.transpose(1, 2)[empty], torch.zeros(int(empty.sum()), H, k_len))
    # rows that do attend somewhere still match torch's module (which gives NaN in the empty ones)
    expected, _ = ref(query, memory, memory, need_weights=need_weights, **call)
    torch.testing.assert_close(out[~empty], expected[~empty], atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    for tensor in (query, memory, *ours.parameters()):
        assert tensor.grad.isfinite().all()
    assert torch.equal(query.grad[empty], torch.zeros(int(empty.sum()), E))


def test_weights_rows_sum_to_one_and_masked_keys_get_exactly_zero() -> None:
    module = MultiHeadAttention(E, H, batch_first=True)
    gen = torch.Generator().manual_seed(5)
    query, memory = torch.randn(2, 4, E, generator=gen), torch.randn(2, 6, E, generator=gen)
    kpm = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    attn = bool_mask((4, 6), gen)
    float_kpm = torch.zeros(2, 6).masked_fill(kpm, -math.inf)
    for call in ({"key_padding_mask": kpm, "attn_mask": attn}, {"key_padding_mask": float_kpm}):
        _, weights = module(query, memory, memory, average_attn_weights=False, **call)  # (B, H, T, S)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, H, 4))
        masked = kpm[:, None, None, :].expand_as(weights)
        if "attn_mask" in call:
            masked = masked | attn
        assert (weights[masked] == 0).all()
        assert (weights[~masked] > 0).all()
        _, averaged = module(query, memory, memory, **call)
        torch.testing.assert_close(averaged, weights.mean(1))


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("how", ["is_causal", "mask", "mask+hint"])
def test_causal_output_ignores_later_positions(need_weights: bool, how: str) -> None:
    module = MultiHeadAttention(E, H, batch_first=True)
    call = {
        "is_causal": {"is_causal": True},
        "mask": {"attn_mask": make_causal_mask(6)},
        "mask+hint": {"attn_mask": make_causal_mask(6), "is_causal": True},
    }[how]
    x = torch.randn(2, 6, E)
    out, _ = module(x, x, x, need_weights=need_weights, **call)
    for i in range(5):
        changed = x.clone()
        changed[:, i + 1 :] = torch.randn(2, 5 - i, E)
        out_changed, _ = module(changed, changed, changed, need_weights=need_weights, **call)
        torch.testing.assert_close(out_changed[:, : i + 1], out[:, : i + 1], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(out_changed[:, i + 1 :], out[:, i + 1 :])


def test_make_causal_mask() -> None:
    assert torch.equal(make_causal_mask(3), torch.tensor([[0, 1, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.bool))
    # queries aligned with the last keys (new positions after a cache)
    expected = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(make_causal_mask(2, num_keys=4), expected)


def _reference_attention(module: MultiHeadAttention, query: Tensor, memory: Tensor, scale: float) -> Tensor:
    """softmax(Q K^T * scale) V per head, merged and projected, written out plainly."""
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    batch, q_len, _ = query.shape
    heads, d_head = module.num_heads, module.head_dim

    def split(x: Tensor) -> Tensor:
        return x.view(batch, -1, heads, d_head).transpose(1, 2)  # (B, H, L, Dh)

    q, k, v = split(query @ w_q.T + b_q), split(memory @ w_k.T + b_k), split(memory @ w_v.T + b_v)
    weights = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)  # (B, H, T, S)
    merged = (weights @ v).transpose(1, 2).reshape(batch, q_len, heads * d_head)
    return merged @ module.out_proj.weight.T + module.out_proj.bias


def test_scaling_uses_head_dim() -> None:
    module = MultiHeadAttention(12, 3, batch_first=True)  # Dh = 4, so 1/sqrt(Dh) != 1/sqrt(D)
    with torch.no_grad():
        module.in_proj_weight.mul_(3.0)  # peaky scores, so the scale matters
    query, memory = torch.randn(2, 3, 12), torch.randn(2, 5, 12)
    expected = _reference_attention(module, query, memory, 1 / math.sqrt(4))
    wrong = _reference_attention(module, query, memory, 1 / math.sqrt(12))
    for need_weights in (False, True):
        out, _ = module(query, memory, memory, need_weights=need_weights)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out, wrong, atol=1e-3)


def test_attention_dropout_only_in_training() -> None:
    module = MultiHeadAttention(E, H, dropout=0.5, batch_first=True)
    plain = MultiHeadAttention(E, H, batch_first=True)
    plain.load_state_dict(module.state_dict())
    x = torch.randn(2, 5, E)
    module.eval()
    for need_weights in (False, True):
        torch.testing.assert_close(module(x, x, x, need_weights=need_weights)[0], plain(x, x, x)[0])
    module.train()
    for need_weights in (False, True):
        first, weights = module(x, x, x, need_weights=need_weights, average_attn_weights=False)
        second, _ = module(x, x, x, need_weights=need_weights)
        assert not torch.allclose(first, second)
    assert (weights == 0).any() and not torch.allclose(weights.sum(-1), torch.ones(2, H, 5))


def test_attention_dropout_drops_weights_with_its_probability_and_rescales_the_rest() -> None:
    """The returned weights in training (as torch's, after dropout): each one zero with probability p, the
    others the eval weights / (1 - p); the output is those weights times V."""
    torch.manual_seed(0)
    module = MultiHeadAttention(E, H, dropout=0.3, batch_first=True)
    x = torch.randn(8, 12, E)
    module.eval()
    _, expected = module(x, x, x, need_weights=True, average_attn_weights=False)  # (8, H, 12, 12)
    module.train()
    _, weights = module(x, x, x, need_weights=True, average_attn_weights=False)
    dropped = weights == 0
    assert abs(dropped.float().mean().item() - 0.3) < 0.03  # 4,608 weights
    torch.testing.assert_close(weights[~dropped], expected[~dropped] / 0.7)


def test_fast_path_gets_minimal_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """No mask when none is given, SDPA's is_causal for a plain causal mask, (B, 1, 1, S) for padding."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        seen.append((None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype), is_causal))
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    module = MultiHeadAttention(E, H, batch_first=True)
    x = torch.randn(2, 5, E)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    module(x, x, x, need_weights=False)
    module(x, x, x, need_weights=False, is_causal=True)
    module(x, x, x, need_weights=False, key_padding_mask=kpm)
    assert seen == [(None, False), (None, True), (((2, 1, 1, 5), torch.bool), False)]


def test_projections_are_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """One in-projection matmul for self-attention, two for cross-attention with key is value."""
    calls = []
    linear = F.linear

    def spy(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    module = MultiHeadAttention(E, H, batch_first=True)
    x, memory = torch.randn(2, 3, E), torch.randn(2, 4, E)
    module(x, x, x)
    assert calls == [(3 * E, E), (E, E)]  # in_proj, out_proj
    calls.clear()
    module(x, memory, memory)
    assert calls == [(E, E), (2 * E, E), (E, E)]  # q, fused k/v, out_proj


def test_token_packing_round_trip() -> None:
    keep = torch.tensor([[True, True, False], [False, True, True]])
    packing = attention.TokenPacking(keep)
    x = torch.randn(2, 3, 4)
    assert len(packing) == 4 and packing.positions.tolist() == [0, 1, 1, 2]
    torch.testing.assert_close(packing.pack(x), x[keep])
    back = packing.unpack(packing.pack(x))
    torch.testing.assert_close(back[keep], x[keep])
    assert torch.all(back[~keep] == 0)


@pytest.mark.parametrize("use_rotary", [False, True])
def test_forward_packed_matches_padded_forward_with_gradients(use_rotary: bool) -> None:
    """Self (causal or padded) and cross attention on packed tokens = the padded path at kept positions."""
    module = MultiHeadAttention(E, H, batch_first=True)
    x, memory = torch.randn(3, 5, E), torch.randn(3, 6, E)
    x_keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    m_pad = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    x_packing, m_packing = attention.TokenPacking(x_keep), attention.TokenPacking(~m_pad)
    hook = rope if use_rotary else None
    cases = [
        (lambda q: module(q, q, q, is_causal=True, need_weights=False, rotary=hook)[0],
         lambda q: module.forward_packed(q, q, x_packing, x_packing, is_causal=True, rotary=hook)),
        (lambda q: module(q, q, q, key_padding_mask=~x_keep, need_weights=False, rotary=hook)[0],
         lambda q: module.forward_packed(q, q, x_packing, x_packing, ~x_keep, rotary=hook)),
        (lambda q: module(q, memory, memory, key_padding_mask=m_pad, need_weights=False)[0],
         lambda q: module.forward_packed(q, m_packing.pack(memory), x_packing, m_packing, m_pad)),
    ]  # fmt: skip
    for padded, packed in cases:
        q = x.clone().requires_grad_()
        expected = padded(q)[x_keep]
        expected.sum().backward()
        expected_grad, q.grad = q.grad[x_keep], None
        got = packed(x_packing.pack(q))
        got.sum().backward()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q.grad[x_keep], expected_grad, atol=1e-5, rtol=1e-5)
