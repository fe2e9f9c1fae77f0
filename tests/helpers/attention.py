"""MultiHeadAttention's tests share: tiny sizes, a module paired with torch's with the same weights, random
boolean masks, a plain rotary embedding."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transformer import MultiHeadAttention

E, H = 8, 2  # tiny: the suite runs thousands of forward passes


def pair_with_torch(
    seed: int = 0, embed_dim: int = E, num_heads: int = H, **kwargs
) -> tuple[nn.Module, nn.Module]:
    """(ours, torch's) with identical weights: same seed and the state_dict loaded both ways."""
    torch.manual_seed(seed)
    ours = MultiHeadAttention(embed_dim, num_heads, **kwargs)
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(embed_dim, num_heads, **kwargs)
    # same registration order and init as torch: the seed alone gives the same weights
    for (name_a, a), (name_b, b) in zip(ours.state_dict().items(), ref.state_dict().items(), strict=True):
        assert name_a == name_b and torch.equal(a, b), name_a
    with torch.no_grad():  # non-zero biases, so a wrong bias slice cannot hide
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ref.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def bool_mask(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    mask = torch.rand(shape, generator=gen) < 0.35
    mask[..., 0] = False  # every query keeps a key: torch's module gives NaN for fully masked rows
    return mask


def rope(x: Tensor, offset: int) -> Tensor:
    """A plain rotary embedding (Su et al., 2021) of (B, H, L, Dh) at positions offset .. offset + L - 1."""
    half = x.shape[-1] // 2
    positions = torch.arange(offset, offset + x.shape[-2], dtype=x.dtype)
    angles = positions[:, None] * 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half)  # (L, Dh/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
