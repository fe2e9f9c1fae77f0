"""Position-wise feed-forward network and the encoder / decoder layers (the paper, Section 3.1-3.3).

Each layer is its sub-layers, each wrapped in dropout + residual + LayerNorm: post-LN as in the paper, or
pre-LN via `norm_first`. Every attention is the one `MultiHeadAttention`; how its calls run on padded,
packed or cached inputs is the business of `transformer.attention_paths`, not of the layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from transformer.attention import KVCache, MultiHeadAttention, RotaryLike, TokenPacking
from transformer.attention_paths import decoder_path, encoder_path
from transformer.config import ACTIVATIONS, Activation
from transformer.dropout import Dropout
from transformer.norm import LayerNorm

__all__ = ["DecoderLayer", "Dropout", "EncoderLayer", "FeedForward"]

Sublayer = Callable[[Tensor], tuple[Tensor, Tensor | None]]  # x -> (output, attention weights or None)


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
        activation: Activation = "relu",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
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
        elif self.activation == "silu":
            hidden = F.silu(hidden)
        else:
            hidden = F.relu(hidden)
        return self.linear2(self.dropout(hidden))


class _SublayerConnections(nn.Module):
    """The residual connection around each sub-layer, followed by LayerNorm (Section 3.1)."""

    norm_first: bool
    dropout: Dropout
    feed_forward: FeedForward

    def _sublayer(self, norm: LayerNorm, x: Tensor, sublayer: Sublayer) -> tuple[Tensor, Tensor | None]:
        """Post-LN (the paper): norm(x + dropout(sublayer(x))); pre-LN: x + dropout(sublayer(norm(x))).
        Returns the new x and the sub-layer's attention weights (or None)."""
        out, weights = sublayer(norm(x) if self.norm_first else x)
        x = self.dropout(out, x)  # x + dropout(out), fused
        return (x if self.norm_first else norm(x)), weights

    def _feed_forward(self, x: Tensor) -> tuple[Tensor, None]:
        return self.feed_forward(x), None


class EncoderLayer(_SublayerConnections):
    """Self-attention then feed-forward, each wrapped in dropout + residual + LayerNorm (Section 3.1)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: Activation = "relu",
        norm_first: bool = False,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=attention_dropout, batch_first=True)
        self.feed_forward = FeedForward(d_model, d_ff, dropout, activation)
        self.norm1 = LayerNorm(d_model, eps=norm_eps)
        self.norm2 = LayerNorm(d_model, eps=norm_eps)
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
        path = encoder_path(need_weights, packing)
        x, weights = self._sublayer(
            self.norm1, x, lambda h: path.self_attention(self.self_attn, h, key_padding_mask, rotary)
        )
        x, _ = self._sublayer(self.norm2, x, self._feed_forward)
        return x, weights


class DecoderLayer(_SublayerConnections):
    """Causal self-attention, cross-attention over the encoder memory, feed-forward (Section 3.1)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: Activation = "relu",
        norm_first: bool = False,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=attention_dropout, batch_first=True)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout=attention_dropout, batch_first=True)
        self.feed_forward = FeedForward(d_model, d_ff, dropout, activation)
        self.norm1 = LayerNorm(d_model, eps=norm_eps)
        self.norm2 = LayerNorm(d_model, eps=norm_eps)
        self.norm3 = LayerNorm(d_model, eps=norm_eps)
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

        Self-attention is causal. Returns (B, T, D) and, if asked, self weights (B, H, T, T_all) and
        cross weights (B, H, T, S). The other arguments choose the execution path
        (`transformer.attention_paths`): with `self_cache` / `cross_cache`, x holds only the new
        positions, which attend to the cached ones (`memory_group` and `self_mask`: the beam layout,
        see `CachedPath`); with `packing` and `memory_packing` (no caches), x is (N, D) and memory
        (M, D), the kept tokens of the (B, T) and (B, S) batches, and the output is (N, D).
        """
        path = decoder_path(
            need_weights, packing, memory_packing, self_cache, cross_cache, memory_group, self_mask
        )
        x, self_weights = self._sublayer(
            self.norm1, x, lambda h: path.causal_self_attention(self.self_attn, h, rotary)
        )
        x, cross_weights = self._sublayer(
            self.norm2, x, lambda h: path.cross_attention(self.cross_attn, h, memory, memory_key_padding_mask)
        )
        x, _ = self._sublayer(self.norm3, x, self._feed_forward)
        return x, self_weights, cross_weights
