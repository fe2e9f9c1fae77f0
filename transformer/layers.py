"""Position-wise feed-forward network and the encoder / decoder layers (the paper, Section 3.1-3.3).

Every attention is the one `MultiHeadAttention`; post-LN (the paper) or pre-LN via `norm_first`.
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

from transformer.attention import KVCache, MultiHeadAttention, RotaryLike


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
        self.dropout = nn.Dropout(dropout)
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


class EncoderLayer(nn.Module):
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
        self.dropout = nn.Dropout(dropout)  # on each sub-layer's output, before the residual add

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        rotary: RotaryLike | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, S, D), key_padding_mask (B, S) True = pad -> (B, S, D), weights (B, H, S, S) if asked."""
        residual = x
        x = self.norm1(x) if self.norm_first else x
        attended, weights = self.self_attn(
            x,
            x,
            x,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            average_attn_weights=False,
            rotary=rotary,
        )
        x = residual + self.dropout(attended)
        x = x if self.norm_first else self.norm1(x)

        residual = x
        x = self.norm2(x) if self.norm_first else x
        x = residual + self.dropout(self.feed_forward(x))
        x = x if self.norm_first else self.norm2(x)
        return x, weights


class DecoderLayer(nn.Module):
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
        self.dropout = nn.Dropout(dropout)

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
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (B, T, D), memory (B, S, D), memory_key_padding_mask (B, S) True = pad.

        Self-attention is causal. With `self_cache`, x holds only the new positions: they attend to
        the cached ones and causally among themselves; `cross_cache` keeps the memory's projections.
        Returns (B, T, D) and, if asked, self weights (B, H, T, T_all) and cross weights (B, H, T, S).
        """
        residual = x
        x = self.norm1(x) if self.norm_first else x
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
        x = residual + self.dropout(attended)
        x = x if self.norm_first else self.norm1(x)

        residual = x
        x = self.norm2(x) if self.norm_first else x
        attended, cross_weights = self.cross_attn(
            x,
            memory,
            memory,
            key_padding_mask=memory_key_padding_mask,
            need_weights=need_weights,
            average_attn_weights=False,
            kv_cache=cross_cache,
        )
        x = residual + self.dropout(attended)
        x = x if self.norm_first else self.norm2(x)

        residual = x
        x = self.norm3(x) if self.norm_first else x
        x = residual + self.dropout(self.feed_forward(x))
        x = x if self.norm_first else self.norm3(x)
        return x, self_weights, cross_weights
