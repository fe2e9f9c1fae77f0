"""The packed (unpadded) path: position-wise work on the non-pad tokens only.

`TokenPacking` gathers the kept tokens of a padded (B, L) batch into one (N, ...) tensor and scatters them
back; `prefix_mask` says which target positions a causal decoder needs. Projections, feed-forward,
LayerNorm and dropout then run on N rows instead of B * L; attention (`MultiHeadAttention.forward_packed`)
runs torch's variable-length kernel on the packed tokens where it can (`transformer.kernels.use_varlen`), or
unpacks to the padded layout, where the masks keep pads out, so real positions get the same numbers.
`Seq2SeqTransformer.pack_tokens` decides when the path is taken (on the CPU by default, where it is
measured faster); a `BatchPacking` built on the host (the collator's) takes it on any device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BatchPacking", "TokenPacking", "prefix_mask"]


class TokenPacking:
    """The kept tokens of a (B, L) batch as one (N, ...) tensor, and the way back ("unpadding").

    Position-wise work (projections, feed-forward, LayerNorm, dropout) on packed tokens skips the
    padding; attention unpacks to the padded (B, H, L, Dh) layout, where masks keep pads out.
    """

    # Known only when built from host-side lengths (`from_index`): what a variable-length attention
    # kernel takes. A packing built from a device mask leaves them None (their max would be a host read).
    cu_seqlens: Tensor | None = None  # (B + 1,) int32: row b's tokens are [cu_seqlens[b], cu_seqlens[b + 1])
    max_len: int | None = None  # the most tokens any row keeps

    def __init__(self, keep: Tensor) -> None:
        """keep (B, L) bool, True = a position that is computed."""
        self.batch, self.length = keep.shape
        self.keep = keep
        self.index = keep.reshape(-1).nonzero().squeeze(1)  # (N,) positions in the flattened B * L

    @classmethod
    def from_index(
        cls,
        index: Tensor,
        batch: int,
        length: int,
        cu_seqlens: Tensor | None = None,
        max_len: int | None = None,
    ) -> TokenPacking:
        """The packing whose kept positions `index` (N,) long (flattened B * L, ascending) were found on the
        host: no `nonzero` on the device, so no device->host read; `keep` is filled in from the index."""
        packing = cls.__new__(cls)
        packing.batch, packing.length = batch, length
        packing.index = index
        keep = torch.zeros(batch * length, dtype=torch.bool, device=index.device)
        packing.keep = keep.index_fill_(0, index, True).view(batch, length)  # (B, L)
        packing.cu_seqlens, packing.max_len = cu_seqlens, max_len
        return packing

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
    """(B, T) bool: every position up to each row's last non-pad token (all that a causal decoder needs),
    and position 0 always: the start token is an input even when it is the pad id (`bos_id == pad_id`, an
    imported Marian model's), and an empty sentence's [start] alone still predicts its EOS."""
    positions = torch.arange(1, tokens.size(1) + 1, device=tokens.device)  # (T,)
    lengths = (tokens.ne(pad_id) * positions).amax(dim=1, keepdim=True)  # (B, 1) last non-pad position + 1
    return positions <= lengths.clamp(min=1)  # (B, T)


@dataclass(frozen=True)
class BatchPacking:
    """A translation batch's packings, built on the host: the source's non-pad tokens and each target's
    prefix (`prefix_mask` of tgt_in). With it `Seq2SeqTransformer.forward` packs on any device without
    reading anything back."""

    source: TokenPacking
    target: TokenPacking

    @classmethod
    def from_collated(cls, packing: Mapping[str, Tensor | int], src: Tensor, tgt_in: Tensor) -> BatchPacking:
        """The collator's `packing` entry (src_/tgt_ index, cu_seqlens, max_len) for the batch src (B, S),
        tgt_in (B, T), on their device (already there when Lightning moved the batch; else a copy that
        does not wait)."""

        def side(prefix: str, tokens: Tensor) -> TokenPacking:
            index, cu_seqlens = (
                torch.as_tensor(packing[f"{prefix}_{name}"]).to(tokens.device, non_blocking=True)
                for name in ("index", "cu_seqlens")
            )
            batch, length = tokens.shape
            max_len = int(packing[f"{prefix}_max_len"])
            return TokenPacking.from_index(index, batch, length, cu_seqlens, max_len)

        return cls(side("src", src), side("tgt", tgt_in))
