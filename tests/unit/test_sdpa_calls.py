"""Which `F.scaled_dot_product_attention` call each attention path makes: causal self-attention through
`is_causal` (no mask built), padding as a (B, 1, 1, S) boolean mask that the fused kernels take, never a
materialized (B, H, T, S) one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend

from transformer import MultiHeadAttention
from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer
from transformer.search.decoding import greedy_search

pytestmark = pytest.mark.usefixtures("one_thread")

B, S, T, H, PAD = 3, 7, 5, 2, 0


@dataclass
class Call:
    is_causal: bool
    mask_shape: tuple[int, ...] | None
    mask_dtype: torch.dtype | None
    q_len: int
    backend: SDPBackend  # the kernel torch picks for these arguments on this device


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Call]]:
    """Every F.scaled_dot_product_attention call made while the test runs, in order."""
    calls: list[Call] = []
    original: Callable[..., Tensor] = F.scaled_dot_product_attention

    def recording(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                  is_causal: bool = False, **kwargs: object) -> Tensor:  # fmt: skip
        # torch._fused_sdp_choice: the backend SDPA dispatches to (private, but it is what SDPA calls)
        backend = SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal))
        shape = None if attn_mask is None else tuple(attn_mask.shape)
        dtype = None if attn_mask is None else attn_mask.dtype
        calls.append(Call(is_causal, shape, dtype, q.shape[2], backend))
        return original(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    yield calls


def _model(pack_tokens: bool) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    config = TransformerConfig(
        src_vocab_size=20, tgt_vocab_size=20, d_model=16, n_heads=H, n_encoder_layers=2,
        n_decoder_layers=2, d_ff=32, dropout=0.1, max_len=32,
    )  # fmt: skip
    model = Seq2SeqTransformer(config)
    model.pack_tokens = pack_tokens
    return model


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(3, 20, (B, S), generator=generator)
    tgt = torch.randint(3, 20, (B, T), generator=generator)
    src[0, 4:] = PAD  # ragged: every path has padding to mask
    src[2, 6:] = PAD
    tgt[1, 3:] = PAD
    return src, tgt


def _assert_fused(calls: list[Call]) -> None:
    """On the CPU, attention dropout 0: the fused (flash) kernel, not the math fallback."""
    assert all(call.backend != SDPBackend.MATH for call in calls), calls


@pytest.mark.parametrize("pack_tokens", [False, True], ids=["padded", "packed"])
def test_training_forward_uses_is_causal_and_a_broadcast_padding_mask(
    sdpa_calls: list[Call], pack_tokens: bool
) -> None:
    model = _model(pack_tokens).train()
    src, tgt = _batch()
    packed_calls = []
    forward_packed = MultiHeadAttention.forward_packed
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            MultiHeadAttention,
            "forward_packed",
            lambda *args, **kwargs: packed_calls.append(1) or forward_packed(*args, **kwargs),
        )
        model(src, tgt).sum().backward()
    assert len(packed_calls) == (6 if pack_tokens else 0)  # the path under test was taken
    encoder_self, decoder = sdpa_calls[:2], sdpa_calls[2:]
    assert len(encoder_self) == 2 and len(decoder) == 4  # 2 encoder layers, then 2 x (self, cross)
    for call in encoder_self + decoder[1::2]:  # encoder self-attention, cross-attention: source padding
        assert (call.is_causal, call.mask_shape, call.mask_dtype) == (False, (B, 1, 1, S), torch.bool)
    for call in decoder[::2]:  # causal self-attention: the kernel's own causal masking, no mask tensor
        assert (call.is_causal, call.mask_shape) == (True, None)
    _assert_fused(sdpa_calls)


def test_causal_with_key_padding_broadcasts_over_heads(sdpa_calls: list[Call]) -> None:
    """Causal + padding (torch's module given both) merges into (B, 1, T, T), not one mask per head."""
    attention = MultiHeadAttention(16, H, batch_first=True).eval()
    x = torch.randn(B, T, 16)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[0, 3:] = True
    attention(x, x, x, key_padding_mask=padding, need_weights=False, is_causal=True)
    causal = torch.ones(T, T, dtype=torch.bool).triu_(1)
    attention(x, x, x, attn_mask=causal, need_weights=False, is_causal=True)  # the hint: mask dropped
    assert [(c.is_causal, c.mask_shape) for c in sdpa_calls] == [(False, (B, 1, T, T)), (True, None)]
    _assert_fused(sdpa_calls)


def test_greedy_decoding_steps_build_no_mask_for_the_cached_self_attention(sdpa_calls: list[Call]) -> None:
    model = _model(pack_tokens=False).eval()
    src, _ = _batch()
    with torch.no_grad():
        greedy_search(model, src, max_len_a=0, max_len_b=4)
    encoder, steps = sdpa_calls[:2], sdpa_calls[2:]
    assert all(call.mask_shape == (B, 1, 1, S) for call in encoder)
    assert len(steps) >= 4 and all(call.q_len == 1 for call in steps)
    for call in steps[1::2]:  # cross-attention: the source padding, broadcast over heads and queries
        assert (call.is_causal, call.mask_shape) == (False, (B, 1, 1, S))
    for call in steps[::2]:  # self-attention: one new query sees every cached key, so no mask at all
        assert call.mask_shape is None
    _assert_fused(sdpa_calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_padded_training_runs_on_the_memory_efficient_kernel() -> None:
    """The (B, 1, 1, S) mask is one that CUDA's memory-efficient kernel takes (flash takes none)."""
    from torch.nn.attention import sdpa_kernel

    model = _model(pack_tokens=False).cuda().train()
    src, tgt = (t.cuda() for t in _batch())
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
        model(src, tgt).float().sum().backward()  # raises if a call needs the math fallback
