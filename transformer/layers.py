"""Position-wise feed-forward network and the encoder / decoder layers (the paper, Section 3.1-3.3).

Every attention is the one `MultiHeadAttention`; post-LN (the paper) or pre-LN via `norm_first`.
The layers run on padded (B, L, D) batches, or on packed (N, D) non-pad tokens given a `TokenPacking`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.attention import KVCache, MultiHeadAttention, RotaryLike, TokenPacking

_MASK_LEVELS = 2**16  # a CPU dropout mask element is 16 random bits


def _dropout_mask(x: Tensor, p: float) -> Tensor:
    """Float32 mask shaped like x: 0 with probability p' = round(p * 2^16) / 2^16, else 1 / (1 - p').

    torch's CPU bernoulli_ draws a double (64 random bits) per element, serially; here four 16-bit fields
    share one 64-bit draw and the rest is vectorized: about 4x faster. A float mask (rather than bool)
    makes applying it one plain multiply in the forward and the backward pass.
    """
    n, levels = x.numel(), round(p * _MASK_LEVELS)
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), None)
    fields = bits.view(torch.int16)[:n].to(torch.float32)  # uniform integers in [-2^15, 2^15)
    scale = _MASK_LEVELS / (_MASK_LEVELS - levels)
    # fields < threshold -> <= 0 -> 0 (dropped), fields >= threshold -> >= scale -> scale (kept)
    threshold = -(2**15) + levels
    return fields.sub_(threshold - 1).mul_(scale).clamp_(0.0, scale).view(x.shape)


class _DropoutAdd(torch.autograd.Function):
    """dropout(x) [+ residual] with a fresh `_dropout_mask`, applied in one pass; backward: grad * mask."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, p: float, residual: Tensor | None) -> Tensor:
        mask = _dropout_mask(x, p)
        ctx.save_for_backward(mask)
        return x * mask if residual is None else torch.addcmul(residual, x, mask)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        (mask,) = ctx.saved_tensors
        return (
            grad * mask if ctx.needs_input_grad[0] else None,
            None,
            grad if ctx.needs_input_grad[2] else None,
        )


class Dropout(nn.Module):
    """Inverted dropout (Srivastava et al., 2014; the paper's P_drop, Section 5.4), as `nn.Dropout`, plus an
    optional fused residual add: `dropout(x, residual)` = residual + dropout(x).

    For float32 on CPU the mask takes 16 random bits per element instead of torch's 64 (`_dropout_mask`),
    so p is rounded to a multiple of 2^-16 (0.1 -> 0.1000061) and survivors are scaled by 1 / (1 - that
    p): the expectation stays exact. Elsewhere torch's own (fused, on GPUs) dropout runs.
    """

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if not self.training or self.p == 0.0:
            return x if residual is None else residual + x
        if x.device.type != "cpu" or x.dtype != torch.float32 or self.p == 1.0:
            dropped = F.dropout(x, self.p, training=True)
            return dropped if residual is None else residual + dropped
        return _DropoutAdd.apply(x, self.p, residual)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Section 3.3); GELU, or SwiGLU (Shazeer, 2020) on request.

    SwiGLU gates with a third matrix: (silu(x W1) * x W3) W2; pick d_ff about 2/3 of the ReLU one to
    keep the parameter count.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        dropout: float = 0.1,
        activation: Literal["relu", "gelu", "swiglu"] = "relu",
    ) -> None:
        super().__init__()
        if activation not in ("relu", "gelu", "swiglu"):
            raise ValueError(f"activation must be one of ['relu', 'gelu', 'swiglu'], got {activation!r}")
        self.activation = activation
        self.linear1 = nn.Linear(d_model, d_ff)
        self.gate = nn.Linear(d_model, d_ff) if activation == "swiglu" else None
        self.dropout = Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T, D) -> (B, T, D)."""
        hidden = self.linear1(x)  # (B, T, d_ff)
        if self.gate is not None:
            hidden = F.silu(hidden) * self.gate(x)
        elif self.activation == "gelu":
            hidden = F.gelu(hidden)
        else:
            hidden = F.relu(hidden)
        return self.linear2(self.dropout(hidden))


class _ResidualLayer(nn.Module):
    """Sub-layer plumbing of `EncoderLayer` and `DecoderLayer`: dropout + residual + LayerNorm (Section 3.1).

    Post-LN (the paper) computes norm(x + dropout(sublayer(x))); pre-LN x + dropout(sublayer(norm(x))).
    """

    norm_first: bool
    dropout: Dropout

    def _pre_norm(self, norm: nn.LayerNorm, x: Tensor) -> Tensor:
        """The sub-layer's input: norm(x) when pre-LN, else x."""
        return norm(x) if self.norm_first else x

    def _add_norm(self, norm: nn.LayerNorm, out: Tensor, residual: Tensor) -> Tensor:
        """residual + dropout(out) (the sub-layer's output), then norm when post-LN."""
        x = self.dropout(out, residual)
        return x if self.norm_first else norm(x)


class EncoderLayer(_ResidualLayer):
    """Self-attention then feed-forward, each wrapped in dropout + residual + LayerNorm (Section 3.1)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: Literal["relu", "gelu", "swiglu"] = "relu",
        norm_first: bool = False,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=attention_dropout, batch_first=True)
        self.feed_forward = FeedForward(d_model, d_ff, dropout, activation)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)  # on each sub-layer's output, before the residual add

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        rotary: RotaryLike | None = None,
        need_weights: bool = False,
        packing: TokenPacking | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, S, D), key_padding_mask (B, S) True = pad -> (B, S, D), weights (B, H, S, S) if asked.

        With `packing`, x holds the (N, D) non-pad tokens of the (B, S) batch (and so does the output);
        only the attention looks at the padded layout.
        """
        residual = x
        x = self._pre_norm(self.norm1, x)
        if packing is not None:
            attended = self.self_attn.forward_packed(x, x, packing, packing, key_padding_mask, rotary=rotary)
            weights = None
        else:
            attended, weights = self.self_attn(
                x,
                x,
                x,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                average_attn_weights=False,
                rotary=rotary,
            )
        x = self._add_norm(self.norm1, attended, residual)

        residual = x
        x = self._pre_norm(self.norm2, x)
        x = self._add_norm(self.norm2, self.feed_forward(x), residual)
        return x, weights


class DecoderLayer(_ResidualLayer):
    """Causal self-attention, cross-attention over the encoder memory, feed-forward (Section 3.1)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: Literal["relu", "gelu", "swiglu"] = "relu",
        norm_first: bool = False,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=attention_dropout, batch_first=True)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout=attention_dropout, batch_first=True)
        self.feed_forward = FeedForward(d_model, d_ff, dropout, activation)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_key_padding_mask: Tensor | None = None,
        *,
        self_cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
        rotary: RotaryLike | None = None,
        need_weights: bool = False,
        packing: TokenPacking | None = None,
        memory_packing: TokenPacking | None = None,
        memory_group: int = 1,
        self_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (B, T, D), memory (B, S, D), memory_key_padding_mask (B, S) True = pad.

        Self-attention is causal. With `self_cache`, x holds only the new positions: they attend to
        the cached ones and causally among themselves; `cross_cache` keeps the memory's projections.
        Returns (B, T, D) and, if asked, self weights (B, H, T, T_all) and cross weights (B, H, T, S).
        With `packing` and `memory_packing` (no caches), x is (N, D) and memory (M, D): the kept tokens
        of the (B, T) and (B, S) batches; the output is (N, D).
        `memory_group` = g > 1: each run of g consecutive rows of x shares one memory row (the beams of a
        sentence), so memory, its mask and `cross_cache` have B / g rows; the g rows' queries attend to
        it together, reading its keys and values once instead of g times. `self_mask` (B / g * H, g, S)
        bool (True = masked) puts the self-attention in the same layout (`DecoderCache.select_beams`):
        T = 1, `self_cache` has a row per sentence holding every beam's keys, and the mask picks each
        beam's own.
        """
        if packing is not None and memory_packing is None:
            raise ValueError("a packed DecoderLayer input needs memory_packing too")
        residual = x
        x = self._pre_norm(self.norm1, x)
        if packing is not None:
            attended = self.self_attn.forward_packed(x, x, packing, packing, is_causal=True, rotary=rotary)
            self_weights = None
        elif self_mask is not None:
            rows, length, d_model = x.shape
            grouped = x.reshape(rows // memory_group, memory_group * length, d_model)  # (B / g, g, D)
            attended, _ = self.self_attn(
                grouped,
                grouped,
                grouped,
                attn_mask=self_mask,
                need_weights=False,
                kv_cache=self_cache,
                rotary=rotary,
            )
            attended, self_weights = attended.reshape(rows, length, d_model), None
        else:
            attended, self_weights = self.self_attn(
                x,
                x,
                x,
                need_weights=need_weights,
                average_attn_weights=False,
                is_causal=True,  # with a cache, MultiHeadAttention aligns the mask with the last T keys
                kv_cache=self_cache,
                rotary=rotary,
            )
        x = self._add_norm(self.norm1, attended, residual)

        residual = x
        x = self._pre_norm(self.norm2, x)
        if packing is not None and memory_packing is not None:
            attended = self.cross_attn.forward_packed(
                x, memory, packing, memory_packing, memory_key_padding_mask
            )
            cross_weights = None
        else:
            rows, length, d_model = x.shape
            attended, cross_weights = self.cross_attn(
                x.reshape(rows // memory_group, memory_group * length, d_model),  # (B / g, g * T, D)
                memory,
                memory,
                key_padding_mask=memory_key_padding_mask,
                need_weights=need_weights,
                average_attn_weights=False,
                kv_cache=cross_cache,
            )
            attended = attended.reshape(rows, length, d_model)
            if cross_weights is not None and memory_group > 1:  # (B / g, H, g * T, S) -> (B, H, T, S)
                heads, keys = cross_weights.shape[1], cross_weights.shape[-1]
                cross_weights = cross_weights.view(rows // memory_group, heads, memory_group, length, keys)
                cross_weights = cross_weights.transpose(1, 2).reshape(rows, heads, length, keys)
        x = self._add_norm(self.norm2, attended, residual)

        residual = x
        x = self._pre_norm(self.norm3, x)
        x = self._add_norm(self.norm3, self.feed_forward(x), residual)
        return x, self_weights, cross_weights
