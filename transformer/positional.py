"""Positional information: sinusoidal (the paper, Section 3.5), learned, and rotary (RoPE).

Absolute encodings are added to the scaled token embeddings; `RotaryEmbedding` instead rotates
queries and keys inside self-attention (it is the `rotary` hook of `MultiHeadAttention`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)); shape (max_len, D)."""
    position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
    # 1 / 10000^(2i/D) for 2i = 0, 2, 4, ...; float64 so that large positions keep their precision
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angles = position * inv_freq  # (max_len, ceil(D/2))
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])  # an odd D has one sine column more
    return table.float()


def _check_span(offset: int, length: int, max_len: int) -> None:
    if offset < 0 or offset + length > max_len:
        raise ValueError(
            f"positions {offset}..{offset + length - 1} are outside the model's max_len ({max_len}); "
            "raise max_len in the config or feed shorter sequences"
        )


def _rows(table: Tensor, offset: int | Tensor, length: int) -> Tensor:
    """Rows offset .. offset+length-1 of a (max_len, ...) table. A tensor offset (0-dim long on the
    table's device: the position of a static decoding step) is looked up on the device, so a compiled
    step serves every position; it is not range-checked here (that would read it back), the searches
    keep positions below max_len (`LengthLimits`)."""
    if isinstance(offset, Tensor):
        return table.index_select(0, offset + torch.arange(length, device=table.device))
    _check_span(offset, length, table.shape[0])
    return table[offset : offset + length]


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoids added to the embeddings (Section 3.5)."""

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        # not persistent: a pure function of the shape, so checkpoints need not carry it
        self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """x (B, T, D) at positions offset .. offset+T-1 -> x + PE, same shape."""
        return x + _rows(self.table, offset, x.size(1)).to(x.dtype)  # (T, D) broadcasts over B


class LearnedPositionalEmbedding(nn.Module):
    """A trained vector per position, added to the embeddings (the paper's Table 3, row (E))."""

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, d_model)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """x (B, T, D) at positions offset .. offset+T-1 -> x + P, same shape."""
        return x + _rows(self.embedding.weight, offset, x.size(1)).to(x.dtype)  # (T, D)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., 2021, RoFormer) in the "rotate half" layout.

    Called by `MultiHeadAttention` as `rotary(x, offset)` on queries and new keys of shape
    (B, H, L, Dh): dimension pair (j, j + Dh/2) at position p is rotated by p * base^(-2j/Dh), so
    q·k depends on positions only through their difference.
    """

    def __init__(self, d_head: int, max_len: int, base: float = 10000.0) -> None:
        super().__init__()
        if d_head % 2:
            raise ValueError(f"RotaryEmbedding needs an even head dimension, got d_head={d_head}")
        self.max_len = max_len
        inv_freq = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)  # (Dh/2,)
        angles = torch.arange(max_len, dtype=torch.float64).unsqueeze(1) * inv_freq  # (max_len, Dh/2)
        angles = torch.cat([angles, angles], dim=-1)  # (max_len, Dh): both halves of a pair share one angle
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """x (B, H, L, Dh) at positions offset .. offset+L-1 -> rotated x, same shape."""
        length = x.size(-2)
        cos = _rows(self.cos, offset, length).to(x.dtype)  # (L, Dh)
        sin = _rows(self.sin, offset, length).to(x.dtype)
        first, second = x.chunk(2, dim=-1)  # (B, H, L, Dh/2) each
        rotated_half = torch.cat([-second, first], dim=-1)  # (B, H, L, Dh)
        return x * cos + rotated_half * sin


ABSOLUTE_POSITIONALS: dict[str, type[nn.Module]] = {
    "sinusoidal": SinusoidalPositionalEncoding,
    "learned": LearnedPositionalEmbedding,
}


def build_absolute_positional(name: str, d_model: int, max_len: int) -> nn.Module | None:
    """The module adding absolute positions for config.positional, or None for "rope" (no absolute ones)."""
    if name == "rope":
        return None
    if name not in ABSOLUTE_POSITIONALS:
        raise ValueError(f"positional must be one of {[*ABSOLUTE_POSITIONALS, 'rope']}, got {name!r}")
    return ABSOLUTE_POSITIONALS[name](d_model, max_len)
