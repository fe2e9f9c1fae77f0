"""Attention's kernels and precision: autocast and fp16 close to float32; which SDPA backends zero fully
masked rows and the fix-up for those that may not; cuDNN where listed; an additive mask equal to its
boolean form; the backends chosen once per search, not in every call."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import transformer.kernels as kernels
from transformer import MultiHeadAttention, make_causal_mask

# torch warns when key_padding_mask and attn_mask have different dtypes; mixing them is tested on purpose
pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched"),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("need_weights", [False, True])
def test_autocast_close_to_fp32(dtype: torch.dtype, need_weights: bool) -> None:
    module = MultiHeadAttention(16, 2, batch_first=True, add_bias_kv=False)
    x, memory = torch.randn(2, 4, 16), torch.randn(2, 5, 16)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0, 3:] = True
    float_mask = torch.zeros(4, 5).masked_fill(make_causal_mask(4, num_keys=5), -math.inf)
    for call in (
        {"key_padding_mask": kpm},
        {"attn_mask": float_mask, "key_padding_mask": kpm},
        {"is_causal": True},
    ):
        keys = x if call.get("is_causal") else memory
        expected, _ = module(x, keys, keys, need_weights=need_weights, **call)
        with torch.autocast("cpu", dtype=dtype):
            out, weights = module(x, keys, keys, need_weights=need_weights, **call)
        assert out.dtype == dtype and out.isfinite().all()
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
        if need_weights:
            assert weights.isfinite().all()
    # a fully padded sentence stays finite (zeros) in low precision too
    kpm[1] = True
    with torch.autocast("cpu", dtype=dtype):
        out, _ = module(x, memory, memory, key_padding_mask=kpm, need_weights=need_weights)
    assert out.isfinite().all()


@pytest.mark.gpu
def test_cuda_fully_masked_rows_and_fp16() -> None:
    module = MultiHeadAttention(64, 4, batch_first=True).cuda().half()
    x = torch.randn(3, 9, 64, device="cuda", dtype=torch.half, requires_grad=True)
    kpm = torch.zeros(3, 9, dtype=torch.bool, device="cuda")
    kpm[1] = True
    for need_weights in (False, True):
        out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        assert out.isfinite().all()
        torch.testing.assert_close(out[1], module.out_proj.bias.expand(9, 64))
        out.float().sum().backward()
        assert x.grad.isfinite().all()


def _empty_row_inputs(device: str, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v (2, 2, 3, 8) and a boolean SDPA mask (True = attend) whose query row 1 of batch 0 is empty."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 8, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    attend = torch.ones(2, 1, 3, 3, dtype=torch.bool, device=device)
    attend[0, :, 1] = False
    attend[1, :, 2, 0] = False
    return q, k, v, attend


def _runs(backend: SDPBackend, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> bool:
    """Whether SDPA runs `backend` for these inputs when it is the only one allowed."""
    with sdpa_kernel([backend]):
        try:
            return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, False)) == backend
        except RuntimeError:  # "No viable backend"
            return False


def _assert_zero_rows_and_finite_grads(out: Tensor, q: Tensor, k: Tensor, v: Tensor) -> None:
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert out.isfinite().all()
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in (q, k, v))
    assert torch.equal(q.grad[0, :, 1], torch.zeros_like(q.grad[0, :, 1]))


@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("backend", sorted(kernels._ZEROING_BACKENDS, key=int), ids=lambda b: b.name)
def test_zeroing_backends_zero_fully_masked_rows_on_cpu(backend: SDPBackend, float_mask: bool) -> None:
    """The claim behind `_ZEROING_BACKENDS`, for the backends the CPU has (math, flash)."""
    q, k, v, attend = _empty_row_inputs("cpu", torch.float32)
    mask = torch.zeros(attend.shape).masked_fill(~attend, -math.inf) if float_mask else attend
    if not _runs(backend, q, k, v, mask):
        pytest.skip(f"{backend.name} does not run on the CPU")
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, mask)
    _assert_zero_rows_and_finite_grads(out, q, k, v)


@pytest.mark.parametrize("float_mask", [False, True])
def test_the_fix_up_zeroes_rows_for_kernels_that_may_not(
    float_mask: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch would pick a kernel outside `_ZEROING_BACKENDS` (cuDNN's), `attend` fixes the rows up: the
    same numbers elsewhere, zeros and zero gradients in the empty row."""
    q, k, v, attend = _empty_row_inputs("cpu", torch.float32)
    kpm = ~attend[:, 0, 0]  # (B, S) torch polarity; row 1 of batch 0 comes from attn_mask below
    attn = torch.zeros(3, 3, dtype=torch.bool)
    attn[1] = True  # query 1 attends to nothing
    kwargs = {"is_causal": False, "need_weights": False}
    if float_mask:
        attn = torch.zeros(3, 3).masked_fill(attn, -math.inf)
    expected, _ = kernels.attend(q, k, v, attn, kpm, **kwargs)
    monkeypatch.setattr(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset())
    monkeypatch.setattr(kernels, "_sdpa_backend", lambda *args: SDPBackend.CUDNN_ATTENTION)
    calls: list[Tensor] = []
    original = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[3]) or original(*a, **kw)
    )
    out, _ = kernels.attend(q, k, v, attn, kpm, **kwargs)
    # the kernel saw no empty row: the fix-up ran
    assert (calls[0] if calls[0].dtype == torch.bool else calls[0] > -math.inf).any(dim=-1).all()
    torch.testing.assert_close(out, expected)
    q.grad = k.grad = v.grad = None
    _assert_zero_rows_and_finite_grads(out, q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "backend",
    [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
    ids=lambda b: b.name,
)
def test_cuda_backends_and_attend_on_fully_masked_rows(backend: SDPBackend) -> None:
    """On a GPU: every backend in `_ZEROING_BACKENDS` zeroes fully masked rows itself (else the claim is
    wrong: take it out of the set), and `attend` gives zeros whichever backends the caller enables (it
    leaves cuDNN's out on CUDA, `_WITHOUT_CUDNN_DEVICES`)."""
    q, k, v, attend = _empty_row_inputs("cuda", torch.bfloat16)
    if not _runs(backend, q, k, v, attend):
        pytest.skip(f"{backend.name} does not take these inputs here")
    with sdpa_kernel([backend]):
        if backend in kernels._ZEROING_BACKENDS:
            _assert_zero_rows_and_finite_grads(F.scaled_dot_product_attention(q, k, v, attend), q, k, v)
            q.grad = k.grad = v.grad = None
        out, _ = kernels.attend(q, k, v, None, ~attend[:, 0, 0], is_causal=False, need_weights=False)
        out2, _ = kernels.attend(q, k, v, ~attend[0, 0], None, is_causal=False, need_weights=False)
    assert out.isfinite().all()
    _assert_zero_rows_and_finite_grads(out2, q, k, v)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sdpa_runs_without_cudnn_on_the_listed_devices(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where `_WITHOUT_CUDNN_DEVICES` lists the device (CUDA; the CPU here): the kernel runs with cuDNN's
    backend off and the caller's setting back afterwards, no row fix-up is added even where torch's chooser
    would say cuDNN, the output is unchanged, and torch.compile traces it without a graph break."""
    from torch._dynamo.utils import counters

    q, k, v, attend = _empty_row_inputs("cpu", torch.float32)
    attn = ~attend[0, 0]  # (T, S), torch polarity: query 1 attends to nothing
    expected, _ = kernels.attend(q, k, v, attn, None, is_causal=False, need_weights=False)
    monkeypatch.setattr(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset())
    monkeypatch.setattr(kernels, "_sdpa_backend", lambda *args: SDPBackend.CUDNN_ATTENTION)
    monkeypatch.setattr(kernels, "_WITHOUT_CUDNN_DEVICES", frozenset({"cpu"}))
    seen: list[tuple[bool, Tensor]] = []
    original = F.scaled_dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> Tensor:
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), args[3]))
        return original(*args, **kwargs)

    call = functools.partial(kernels.attend, is_causal=False, need_weights=False)
    if compiled:
        torch._dynamo.reset()
        counters.clear()
        call = torch.compile(call, fullgraph=True, backend="eager")  # fullgraph: a break raises
    else:  # (the recording itself would break the graph)
        monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    out, _ = call(q, k, v, attn, None)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
    torch.testing.assert_close(out, expected)
    if not compiled:
        assert seen == [(False, seen[0][1])]
        assert not seen[0][1][1].any()  # the empty row reached the kernel as it is: no fix-up
    else:
        assert counters["graph_break"] == {}
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_additive_mask_gives_the_same_output_as_its_boolean_form(dtype: torch.dtype) -> None:
    """`kernels.additive_mask` is what SDPA makes of a boolean mask itself: the same bits out, for a
    padding mask and an attention mask, in float32 and bfloat16 (the decoding caches rely on it)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 4, 8, dtype=dtype) for _ in range(3))
    padding = torch.tensor([[False] * 4, [False, False, True, True], [False, True, True, True]])  # (B, S)
    causal = kernels.make_causal_mask(4)  # (T, S)
    for attn, pad in ((None, padding), (causal, None), (causal, padding)):
        expected, _ = kernels.attend(q, k, v, attn, pad, is_causal=False, need_weights=False)
        out, _ = kernels.attend(
            q,
            k,
            v,
            None if attn is None else kernels.additive_mask(attn, dtype),
            None if pad is None else kernels.additive_mask(pad, dtype),
            is_causal=False,
            need_weights=False,
        )
        assert torch.equal(out, expected)
    mask = kernels.additive_mask(padding, dtype)
    assert mask.dtype == dtype and torch.equal(mask.isneginf(), padding) and not mask[~padding].any()


def test_attention_dtype_follows_autocast() -> None:
    x = torch.zeros(2, 3)
    assert kernels.attention_dtype(x) == torch.float32
    assert kernels.attention_dtype(x.bfloat16()) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels.attention_dtype(x) == torch.bfloat16


def test_a_search_enters_the_backends_once_not_in_every_attention_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a `_WITHOUT_CUDNN_DEVICES` device (CUDA; the CPU here) a search enters `attention_backends` once
    around its loop; its attention calls, finding cuDNN's backend already off, do not enter it again (the
    context costs ~10-20 µs a call, more than a small kernel). A call outside a search still enters it."""
    from tests.helpers.tiny import tiny_seq2seq, tiny_sources
    from transformer.search.decoding import DecodingSettings, search

    monkeypatch.setattr(kernels, "_WITHOUT_CUDNN_DEVICES", frozenset({"cpu"}))
    entered: list[bool] = []
    original = kernels.sdpa_kernel

    def counted(*args: Any, **kwargs: Any) -> Any:
        entered.append(torch.backends.cuda.cudnn_sdp_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "sdpa_kernel", counted)
    cudnn_off: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> Tensor:
        cudnn_off.append(not torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = tiny_seq2seq(0, vocab=24)
    for beam_size in (1, 4):
        entered.clear()
        cudnn_off.clear()
        search(model, tiny_sources(4, vocab=24), DecodingSettings(beam_size=beam_size, max_len_b=6))
        assert entered == [True]  # once, by the search
        assert len(cudnn_off) > 10 and all(cudnn_off)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
    entered.clear()
    q = torch.randn(1, 2, 3, 4)
    kernels.attend(q, q, q, None, torch.tensor([[False, False, True]]), is_causal=False, need_weights=False)
    assert entered == [True]


def test_under_autocast_the_chooser_is_not_trusted_with_other_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autocast casts SDPA's float32 inputs but not the chooser's: the fix-up runs whatever it says."""
    monkeypatch.setattr(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset())
    monkeypatch.setattr(kernels, "_sdpa_backend", lambda *args: SDPBackend.EFFICIENT_ATTENTION)
    q, k, v, attend = _empty_row_inputs("cpu", torch.float32)
    assert not kernels._kernel_leaves_empty_rows(q, k, v, attend, 0.0, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels._kernel_leaves_empty_rows(q, k, v, attend, 0.0, False)
        assert not kernels._kernel_leaves_empty_rows(q.bfloat16(), k, v, attend, 0.0, False)
