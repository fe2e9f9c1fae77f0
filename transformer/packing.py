"""The packed (unpadded) path: position-wise work on the non-pad tokens only.

`TokenPacking` gathers the kept tokens of a padded (B, L) batch into one (N, ...) tensor and scatters them
back; `prefix_mask` says which target positions a causal decoder needs. Projections, feed-forward,
LayerNorm and dropout then run on N rows instead of B * L; attention (`MultiHeadAttention.forward_packed`)
unpacks to the padded layout, where the masks keep pads out, so real positions get the same numbers.
`Seq2SeqTransformer.pack_tokens` decides when the path is taken (on the CPU by default, where it is
measured faster).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TokenPacking", "prefix_mask"]


class TokenPacking:
    """The kept tokens of a (B, L) batch as one (N, ...) tensor, and the way back ("unpadding").

    Position-wise work (projections, feed-forward, LayerNorm, dropout) on packed tokens skips the
    padding; attention unpacks to the padded (B, H, L, Dh) layout, where masks keep pads out.
    """

    def __init__(self, keep: Tensor) -> None:
        """keep (B, L) bool, True = a position that is computed."""
        self.batch, self.length = keep.shape
        self.keep = keep
        self.index = keep.reshape(-1).nonzero().squeeze(1)  # (N,) positions in the flattened B * L

    def __len__(self) -> int:
        return self.index.numel()

    @property
    def positions(self) -> Tensor:
        """(N,) long: each kept token's position within its row."""
        return self.index % self.length

    def pack(self, x: Tensor) -> Tensor:
        """(B, L, ...) -> (N, ...), the kept positions in row-major order (= x[keep])."""
        return x.reshape(self.batch * self.length, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, ...) -> (B, L, ...), zeros at the positions not kept (finite: masked keys stay harmless)."""
        out = x.new_zeros(self.batch * self.length, *x.shape[1:])
        return out.index_copy_(0, self.index, x).view(self.batch, self.length, *x.shape[1:])


def prefix_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """(B, T) bool: every position up to each row's last non-pad token (all that a causal decoder needs)."""
    positions = torch.arange(1, tokens.size(1) + 1, device=tokens.device)  # (T,)
    lengths = (tokens.ne(pad_id) * positions).amax(dim=1, keepdim=True)  # (B, 1) last non-pad position + 1
    return positions <= lengths  # (B, T)
