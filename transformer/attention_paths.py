"""How the attention sub-layers of `EncoderLayer` / `DecoderLayer` run on each execution path.

The layers read like the paper and hand their attention calls to one of three paths:
- `PaddedPath`: (B, L, D) batches with padding masks; optionally returns the per-head weights.
- `PackedPath`: the (N, D) non-pad tokens of a batch (`transformer.packing`); position-wise layers
  skip the padding, attention runs on them with torch's variable-length kernel where `kernels.use_varlen`
  allows, else in the padded layout (`MultiHeadAttention.forward_packed`).
- `CachedPath`: incremental decoding over `KVCache`s (`transformer.kv_cache`), optionally in the beam
  layout, where g consecutive decoder rows share one memory row and one self-attention cache row.
Each call returns (output, per-head attention weights or None). `encoder_path` / `decoder_path` pick
the path from the layers' keyword arguments.
"""

from __future__ import annotations

from torch import Tensor

from transformer.attention import MultiHeadAttention
from transformer.kernels import RotaryLike
from transformer.kv_cache import KVCache
from transformer.packing import TokenPacking

__all__ = ["CachedPath", "PackedPath", "PaddedPath", "decoder_path", "encoder_path"]

Attended = tuple[Tensor, Tensor | None]  # (output, per-head weights (B, H, T, S) or None)


class PaddedPath:
    """Padded (B, L, D) inputs; `need_weights` returns each sub-layer's per-head weights."""

    def __init__(self, need_weights: bool = False) -> None:
        self.need_weights = need_weights

    def self_attention(
        self,
        attention: MultiHeadAttention,
        x: Tensor,
        key_padding_mask: Tensor | None,
        rotary: RotaryLike | None,
    ) -> Attended:
        """x (B, S, D), key_padding_mask (B, S) True = pad -> (B, S, D)."""
        return attention(
            x,
            x,
            x,
            key_padding_mask=key_padding_mask,
            need_weights=self.need_weights,
            average_attn_weights=False,
            rotary=rotary,
        )

    def causal_self_attention(
        self, attention: MultiHeadAttention, x: Tensor, rotary: RotaryLike | None
    ) -> Attended:
        """x (B, T, D) -> (B, T, D); position i attends to positions <= i."""
        return attention(
            x, x, x, need_weights=self.need_weights, average_attn_weights=False, is_causal=True, rotary=rotary
        )

    def cross_attention(
        self, attention: MultiHeadAttention, x: Tensor, memory: Tensor, memory_key_padding_mask: Tensor | None
    ) -> Attended:
        """x (B, T, D) attends to memory (B, S, D) -> (B, T, D)."""
        return attention(
            x,
            memory,
            memory,
            key_padding_mask=memory_key_padding_mask,
            need_weights=self.need_weights,
            average_attn_weights=False,
        )


class PackedPath:
    """Packed inputs: x (N, D) holds the tokens `packing` keeps of a (B, T) batch, memory (M, D) those
    `memory_packing` keeps of a (B, S) one. No weights are returned."""

    def __init__(self, packing: TokenPacking, memory_packing: TokenPacking | None = None) -> None:
        self.packing = packing
        self.memory_packing = memory_packing

    def self_attention(
        self,
        attention: MultiHeadAttention,
        x: Tensor,
        key_padding_mask: Tensor | None,
        rotary: RotaryLike | None,
    ) -> Attended:
        packing = self.packing
        return attention.forward_packed(x, x, packing, packing, key_padding_mask, rotary=rotary), None

    def causal_self_attention(
        self, attention: MultiHeadAttention, x: Tensor, rotary: RotaryLike | None
    ) -> Attended:
        packing = self.packing
        return attention.forward_packed(x, x, packing, packing, is_causal=True, rotary=rotary), None

    def cross_attention(
        self, attention: MultiHeadAttention, x: Tensor, memory: Tensor, memory_key_padding_mask: Tensor | None
    ) -> Attended:
        assert self.memory_packing is not None, "decoder_path checks it"
        return attention.forward_packed(
            x, memory, self.packing, self.memory_packing, memory_key_padding_mask
        ), None


class CachedPath:
    """Incremental decoding: x (B, T, D) holds only the new positions; `self_cache` keeps the earlier
    keys/values, `cross_cache` the memory's projections.

    `memory_group` = g > 1: each run of g consecutive rows of x shares one memory row (the beams of a
    sentence), so memory, its mask and `cross_cache` have B / g rows; the g rows' queries attend to it
    together, reading its keys and values once instead of g times. `self_mask` (B / g * H, g, S) bool
    (True = masked) puts the self-attention in the same layout (`DecoderCache.select_beams`): T = 1,
    `self_cache` has a row per sentence holding every beam's keys, and the mask picks each beam's own.
    """

    def __init__(
        self,
        self_cache: KVCache | None,
        cross_cache: KVCache | None,
        need_weights: bool = False,
        memory_group: int = 1,
        self_mask: Tensor | None = None,
    ) -> None:
        self.self_cache, self.cross_cache = self_cache, cross_cache
        self.need_weights = need_weights
        self.memory_group = memory_group
        self.self_mask = self_mask

    def causal_self_attention(
        self, attention: MultiHeadAttention, x: Tensor, rotary: RotaryLike | None
    ) -> Attended:
        if self.self_mask is None:
            return attention(
                x,
                x,
                x,
                need_weights=self.need_weights,
                average_attn_weights=False,
                is_causal=True,  # with a cache, MultiHeadAttention aligns the mask with the last T keys
                kv_cache=self.self_cache,
                rotary=rotary,
            )
        rows, length, d_model = x.shape
        grouped = x.reshape(rows // self.memory_group, self.memory_group * length, d_model)  # (B / g, g, D)
        attended, _ = attention(
            grouped,
            grouped,
            grouped,
            attn_mask=self.self_mask,
            need_weights=False,
            kv_cache=self.self_cache,
            rotary=rotary,
        )
        return attended.reshape(rows, length, d_model), None

    def cross_attention(
        self, attention: MultiHeadAttention, x: Tensor, memory: Tensor, memory_key_padding_mask: Tensor | None
    ) -> Attended:
        group = self.memory_group
        rows, length, d_model = x.shape
        attended, weights = attention(
            x.reshape(rows // group, group * length, d_model),  # (B / g, g * T, D)
            memory,
            memory,
            key_padding_mask=memory_key_padding_mask,
            need_weights=self.need_weights,
            average_attn_weights=False,
            kv_cache=self.cross_cache,
        )
        attended = attended.reshape(rows, length, d_model)
        if weights is not None and group > 1:  # (B / g, H, g * T, S) -> (B, H, T, S)
            heads, keys = weights.shape[1], weights.shape[-1]
            weights = weights.view(rows // group, heads, group, length, keys)
            weights = weights.transpose(1, 2).reshape(rows, heads, length, keys)
        return attended, weights


def encoder_path(need_weights: bool = False, packing: TokenPacking | None = None) -> PaddedPath | PackedPath:
    """The path of an `EncoderLayer` call: packed if given a packing, padded otherwise."""
    return PaddedPath(need_weights) if packing is None else PackedPath(packing)


def decoder_path(
    need_weights: bool = False,
    packing: TokenPacking | None = None,
    memory_packing: TokenPacking | None = None,
    self_cache: KVCache | None = None,
    cross_cache: KVCache | None = None,
    memory_group: int = 1,
    self_mask: Tensor | None = None,
) -> PaddedPath | PackedPath | CachedPath:
    """The path of a `DecoderLayer` call: packed if given packings (caches are then unused), cached if
    given a cache or the beam layout, padded otherwise."""
    if packing is not None:
        if memory_packing is None:
            raise ValueError("a packed DecoderLayer input needs memory_packing too")
        return PackedPath(packing, memory_packing)
    if self_cache is None and cross_cache is None and memory_group == 1 and self_mask is None:
        return PaddedPath(need_weights)
    return CachedPath(self_cache, cross_cache, need_weights, memory_group, self_mask)
