"""The cached path: keys and values kept across decoding steps (incremental decoding, §3.2.3 decoder).

`KVCache` holds one attention layer's projected keys and values; `DecoderCache` holds a `Decoder`'s
(a self- and a cross-attention cache per layer) and the beam layout, in which the beams of a sentence
share one cache row and a per-step mask picks each beam's own keys (`DecoderCache.select_beams`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from transformer.kernels import RotaryLike, additive_mask

__all__ = ["DecoderCache", "KVCache"]


class KVCache:
    """Projected keys and values of one attention layer, kept across decoding steps (§3.2.3, decoder).

    `static=False` (decoder self-attention): each call's `key`/`value` are only the new positions;
    their projections are appended and the query attends to everything cached so far.
    `static=True` (encoder-decoder attention): the first call projects `key`/`value` (the memory) and
    stores them; later calls reuse them and may pass `key=value=None`.

    A self-attention cache is stored position-major, (capacity, B, H, Dh), its capacity doubling when
    full (in multiples of `BLOCK` positions): an append writes one contiguous slab in place (no copy of
    the cache per step) and `reorder` gathers the filled prefix into a contiguous one. `key` / `value`
    are (B, H, S, Dh) views.
    """

    BLOCK = 16

    def __init__(self, static: bool = False) -> None:
        self.static = static
        # static: (B, H, S, Dh) as given; otherwise (capacity, B, H, Dh), positions >= len(self) unused
        self._key: Tensor | None = None
        self._value: Tensor | None = None
        self._length = 0
        self.reserved = 0  # the capacity the first append allocates, when the final length is known

    @property
    def key(self) -> Tensor | None:
        """(B, H, S, Dh) cached keys, or None."""
        return self._view(self._key)

    @property
    def value(self) -> Tensor | None:
        """(B, H, S, Dh) cached values, or None."""
        return self._view(self._value)

    def _view(self, buffer: Tensor | None) -> Tensor | None:
        if buffer is None or self.static:
            return buffer
        return buffer[: self._length].permute(1, 2, 0, 3)  # (S, B, H, Dh) -> (B, H, S, Dh)

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        shape = None if self.key is None else tuple(self.key.shape)
        return f"KVCache(static={self.static}, key_shape={shape})"

    def reorder(self, index: Tensor) -> None:
        """Select batch entries in place (beam search keeps, repeats or drops hypotheses)."""
        if self._key is None or self._value is None:
            return
        if self.static:
            self._key, self._value = self._key.index_select(0, index), self._value.index_select(0, index)
            return
        self._key, self._value = self._select(self._key, index), self._select(self._value, index)

    def _select(self, buffer: Tensor, index: Tensor) -> Tensor:
        """(capacity, B, H, Dh) -> (capacity, B', H, Dh) holding rows `index` of the filled positions."""
        if buffer.requires_grad and torch.is_grad_enabled():  # out= is not differentiable
            return buffer[: self._length].index_select(1, index)
        out = buffer.new_empty(buffer.shape[0], index.numel(), *buffer.shape[2:])
        torch.index_select(buffer[: self._length], 1, index, out=out[: self._length])  # contiguous prefix
        return out

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store new (B, H, L, Dh) keys/values (appended unless static) and return all cached ones."""
        if self.static:
            self._key, self._value, self._length = key, value, key.shape[2]
            return key, value
        new_key, new_value = key.permute(2, 0, 1, 3), value.permute(2, 0, 1, 3)  # (L, B, H, Dh)
        length = self._length + key.shape[2]
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            # training through a cache: autograd must see a concatenation, not in-place writes
            self._key = new_key if self._key is None else torch.cat([self._key[: self._length], new_key])
            self._value = (
                new_value if self._value is None else torch.cat([self._value[: self._length], new_value])
            )
        else:
            if self._key is None or self._value is None or length > self._key.shape[0]:
                self._key, self._value = (
                    self._grow(self._key, new_key, length),
                    self._grow(self._value, new_value, length),
                )
            self._key[self._length : length] = new_key
            self._value[self._length : length] = new_value
        self._length = length
        return self.key, self.value  # (B, H, S + L, Dh)

    def _grow(self, buffer: Tensor | None, new: Tensor, length: int) -> Tensor:
        """A (capacity, B, H, Dh) buffer with room for `length` positions that holds the filled part of
        `buffer`; the capacity at least doubles (rounded up to BLOCK), so n appends copy O(n) in all."""
        held = 0 if buffer is None else buffer.shape[0]
        capacity = -(-max(length, 2 * held, self.reserved) // self.BLOCK) * self.BLOCK
        grown = new.new_empty(capacity, *new.shape[1:])
        if buffer is not None and self._length:
            grown[: self._length] = buffer[: self._length]
        return grown


class DecoderCache:
    """Incremental-decoding state of a `Decoder`: per layer a self- and a cross-attention `KVCache`.

    `offset` is the number of target positions already decoded (the position of the next one).
    `reorder(index)` selects batch rows (dropping finished sentences, or any row gather).
    `select_beams(parents, sentences)` switches to the beam layout, where the g = `beams` consecutive
    decoder rows of a sentence share one row of every cache: the cross-attention caches, the memory and
    its padding mask hold one row per sentence, and each self-attention cache row holds the keys and
    values of all the sentence's beams, g new ones per step, never moved. `key_paths` (n, g, t) says
    which of those keys form each beam's prefix, and attention masks out the rest, so a beam-search
    step re-points a few indices instead of gathering every layer's cache (fairseq and Hugging Face
    copy it all, O(t) per step).
    """

    def __init__(self, n_layers: int) -> None:
        self.self_attn = [KVCache(static=False) for _ in range(n_layers)]
        self.cross_attn = [KVCache(static=True) for _ in range(n_layers)]
        self.key_paths: Tensor | None = None  # (n, g, t) long, in the beam layout; None: row = hypothesis
        self.source_mask: Tensor | None = None  # (n, S) additive, with the cross-attention caches

    @property
    def beams(self) -> int:
        """g: decoder rows per cache row (1 outside the beam layout)."""
        return 1 if self.key_paths is None else self.key_paths.shape[1]

    @property
    def offset(self) -> int:
        return len(self.self_attn[0]) if self.key_paths is None else self.key_paths.shape[-1]

    def reserve(self, keys: int) -> None:
        """Allocate room for `keys` self-attention keys per row at the first step (no regrowth copies)."""
        for cache in self.self_attn:
            cache.reserved = keys

    def reorder(self, index: Tensor, memory_index: Tensor | None = None) -> None:
        """Keep rows `index` (LongTensor (B',)) of the self-attention caches and rows `memory_index` of the
        cross-attention caches (default: `index`, when each row has its own memory), in that order."""
        if self.key_paths is not None:
            raise RuntimeError("reorder() selects hypotheses; in the beam layout use select_beams()")
        self._reorder(self.self_attn, index)
        self._reorder_memory(index if memory_index is None else memory_index)

    def select_beams(self, parents: Tensor, sentences: Tensor | None = None) -> None:
        """The next step's beams: for each kept sentence i (`sentences` (n',) rows of the current ones;
        None: all of them, in order), new beam j extends the current beam `parents[i, j]` ((n', g')
        long, in 0 .. beams - 1). Only index tensors move: nothing is read back to the host.

        The first call turns a cache of one hypothesis per row into the beam layout."""
        if self.key_paths is None:
            held = len(self.self_attn[0])
            rows = 0 if self.self_attn[0].key is None else self.self_attn[0].key.shape[0]
            self.key_paths = torch.arange(held, device=parents.device).expand(rows, 1, held)
        paths = (
            self.key_paths if sentences is None else self.key_paths.index_select(0, sentences)
        )  # (n', g, t)
        self.key_paths = paths.gather(1, parents.unsqueeze(-1).expand(-1, -1, paths.shape[-1]))  # (n', g', t)
        if sentences is not None:
            self._reorder(self.self_attn, sentences)
            self._reorder_memory(sentences)

    def memory_mask(self, padding_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
        """The encoder-decoder attention's key mask: the source padding mask (n, S) (True = pad) of the
        first cached call, kept as an additive mask in `dtype` (`kernels.additive_mask`) and reordered
        with the cross-attention caches, as the memory is projected once into them; later calls' masks
        are not read. One conversion per search instead of one in every attention call of every step."""
        if self.source_mask is None and padding_mask is not None:
            self.source_mask = additive_mask(padding_mask, dtype)
        return self.source_mask

    def step_mask(self, heads: int, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """In the beam layout, start a step: each beam's new key goes after the cached ones, and the
        returned (n * heads, g, S) additive mask in `dtype` (0 = attended, -inf = masked) lets a beam's
        query see its prefix and its own new key only. None outside the beam layout."""
        if self.key_paths is None:
            return None
        sentences, beams, _ = self.key_paths.shape
        cached = len(self.self_attn[0])
        new_keys = torch.arange(cached, cached + beams, device=self.key_paths.device)
        self.key_paths = torch.cat([self.key_paths, new_keys.expand(sentences, beams).unsqueeze(-1)], dim=-1)
        mask = torch.full(
            (sentences, 1, beams, cached + beams), -math.inf, dtype=dtype, device=new_keys.device
        ).scatter_(-1, self.key_paths.unsqueeze(1), 0.0)  # (n, 1, g, S)
        return mask.expand(-1, heads, -1, -1).reshape(sentences * heads, beams, cached + beams)

    def start_step(
        self, length: int, heads: int, rotary: RotaryLike | None, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor | None, RotaryLike | None]:
        """Begin a decoder pass over `length` new positions: the self-attention mask (attention's compute
        `dtype`) and rotary hook the layers use. Outside the beam layout: (None, rotary) (the layers'
        causal masks suffice); in it, `step_mask` and a rotary that places all g new keys of a sentence at
        the same position."""
        if self.key_paths is None:
            return None, rotary
        if length != 1:
            raise ValueError(f"a beam-layout DecoderCache takes one position per step, got {length}")
        position = self.offset
        self_mask = self.step_mask(heads, dtype)
        return self_mask, None if rotary is None else _at_position(rotary, position)

    def _reorder_memory(self, index: Tensor) -> None:
        self._reorder(self.cross_attn, index)
        if self.source_mask is not None:
            self.source_mask = self.source_mask.index_select(0, index)

    @staticmethod
    def _reorder(caches: list[KVCache], index: Tensor) -> None:
        for cache in caches:
            cache.reorder(index)


def _at_position(rotary: RotaryLike, position: int) -> RotaryLike:
    """Rotary for the beam layout: all g new keys / queries of a sentence, (n, H, g, Dh), sit at
    `position`, whatever the number of keys already cached."""

    def rotate(x: Tensor, offset: int) -> Tensor:
        return rotary(x.reshape(x.shape[0], -1, 1, x.shape[-1]), position).view(x.shape)

    return rotate
