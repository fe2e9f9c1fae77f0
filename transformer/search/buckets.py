"""Shape buckets of the compiled decoding step (`decode.kv_cache=compiled`): a search's cache rows,
source width and cache capacity are padded up to a few sizes, so that one process compiles the step
at most twice (greedy search and beam search: the sizes are dynamic dimensions of one graph each) and
records at most one CUDA graph per bucket (each replays on its bucket's fixed-address buffers).

The sizes are powers of two: rows (sentences) from 2, the source width from 16, the cache capacity
(self-attention slots per row) from `KVCache.BLOCK`. Powers of two keep the buckets few (about
log2(largest / smallest) per dimension) at a cost of at most 2x padding in each; the smallest sizes
stay above 1, which Dynamo would specialize (sizes 0 and 1 are never dynamic). Plain Python, checked on
the CPU: the CUDA path only replays what this module decides.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from transformer.search.ensemble import EnsembleCache
from transformer.search.step import Searchable, StepRules, next_log_probs

__all__ = ["Bucket", "BucketCache", "BucketedCache", "bucket_size", "mark_dynamic", "pad_rows"]

LEAST_ROWS = 2  # a row count of 1 would be specialized by Dynamo: a graph of its own
LEAST_SOURCE = 16
LEAST_CAPACITY = 16  # KVCache.BLOCK, the rounding of `static_capacity`

Value = TypeVar("Value")


class Buffers(Protocol):
    """`static_cache.StaticBuffers` (which builds on this module): fixed-address zero-filled tensors."""

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor: ...


class StaticCache(Protocol):
    """`static_cache.StaticDecoderCache`, as far as the buckets use it."""

    visible: Tensor  # (n, g, C) bool
    self_attn: list  # StaticKVCache per layer: _key / _value (C, n, H, Dh)
    cross_attn: list  # KVCache per layer: _key / _value (n, H, S, Dh)

    @property
    def beams(self) -> int: ...
    @property
    def offset(self) -> Tensor: ...
    def select_beams(self, parents: Tensor, sentences: Tensor | None = None) -> None: ...


# `new_static_cache` for one model: (rows, capacity, device, buffers) -> its static cache
MakeCache = Callable[[int, int, torch.device, Buffers], "StaticCache | EnsembleCache"]


def bucket_size(size: int, least: int) -> int:
    """The bucket of `size`: the smallest power of two >= size, at least `least` (a power of two)."""
    return max(least, 1 << max(size - 1, 0).bit_length())


@dataclass(frozen=True)
class Bucket:
    """The padded shapes of one search's compiled steps: `rows` cache rows (sentences; the decoder runs
    rows * beams of them), a `source` width, `capacity` self-attention slots per row, `beams` per row
    (1: greedy search and sampling). One CUDA graph per bucket."""

    rows: int
    source: int
    capacity: int
    beams: int

    @classmethod
    def of(cls, rows: int, source: int, capacity: int, beams: int) -> Bucket:
        """The bucket of a search of `rows` sentences, `source` tokens wide, that needs `capacity` slots."""
        return cls(
            bucket_size(rows, LEAST_ROWS),
            bucket_size(source, LEAST_SOURCE),
            bucket_size(capacity, LEAST_CAPACITY),
            beams,
        )


class BucketCache(Generic[Value]):
    """What each bucket keeps from one search to the next (its fixed-address buffers), made by `make` on
    the bucket's first search and reused by every later one. At most `limit` buckets are held: beyond,
    the least recently used is dropped (its buffers freed; should the bucket come back, its CUDA graph
    is recorded again), which bounds the memory of the buckets' buffers to `limit` searches."""

    def __init__(self, make: Callable[[], Value], limit: int = 8) -> None:
        if limit < 1:
            raise ValueError(f"a BucketCache holds at least one bucket, got limit={limit}")
        self._make = make
        self._held: OrderedDict[Bucket, Value] = OrderedDict()
        self.limit = limit
        self.made = 0  # buckets made (first searches, or returns after being dropped)

    def __getitem__(self, bucket: Bucket) -> Value:
        if bucket in self._held:
            self._held.move_to_end(bucket)
            return self._held[bucket]
        value = self._held[bucket] = self._make()
        self.made += 1
        while len(self._held) > self.limit:
            self._held.popitem(last=False)
        return value

    def __contains__(self, bucket: object) -> bool:
        return bucket in self._held

    def __len__(self) -> int:
        return len(self._held)


def pad_rows(tensor: Tensor, rows: int, out: Tensor | None = None) -> Tensor:
    """tensor (N, ...) -> (rows, ...): its N rows first, then zeros (False); into `out` when given
    (a fixed-address buffer whose padding rows are already zero)."""
    if out is None:
        out = tensor.new_zeros((rows, *tensor.shape[1:]))
    out[: tensor.shape[0]].copy_(tensor)
    return out


def mark_dynamic(tensors: Sequence[tuple[Tensor, tuple[int, ...]]]) -> None:
    """Tell Dynamo which dimensions vary from bucket to bucket (rows, source width, capacity, beams),
    so that the first compilation is already the dynamic graph every bucket shares (without this it
    compiles once static, again dynamic, then again whenever another dimension first changes). `maybe`:
    should a dimension be specialized after all, Dynamo recompiles (counted, bounded) instead of
    failing. Marked dimensions are never duck-sized (two equal sizes are not assumed to stay equal)."""
    for tensor, dims in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, list(dims))


class BucketedCache:
    """The cache of a compiled search (`Stepping.buckets`): a static cache padded to the search's
    `Bucket` (rows, source width, capacity), made at the first step, when the source width is known, on
    the bucket's fixed-address `StaticBuffers`. The search sees its own `rows` sentences; the step sees
    the bucket's, the padding rows with zero memory, nothing masked, token 0, never at their maximum
    length (their outputs are dropped: rows never mix, so they change no sentence's result).
    Beam parents for the padding rows are beam 0."""

    def __init__(
        self, make: MakeCache, rows: int, capacity: int, beams: int, buckets: BucketCache[Buffers]
    ) -> None:
        self.make, self.rows, self.capacity, self.beam_size = make, rows, capacity, beams
        self.buckets = buckets
        self.bucket: Bucket | None = None
        self.cache: StaticCache | EnsembleCache | None = None
        self.memory: object = None  # padded: (rows, source, D), or one per ensemble member
        self.mask: Tensor | None = None  # (rows, source) bool, True = pad
        self.tokens: Tensor | None = None  # (rows * g,) the compiled steps' last tokens
        self.flags: Tensor | None = None  # (rows * g,) bool: at the maximum length

    @property
    def offset(self) -> Tensor:
        assert self.cache is not None, "made at the first step"
        return self.cache.offset

    def start(self, memory: object, src_padding_mask: Tensor) -> None:
        """The first step: the bucket, its buffers, the static cache, the padded memory and mask."""
        rows, source = src_padding_mask.shape
        bucket = self.bucket = Bucket.of(rows, source, self.capacity, self.beam_size)
        buffers, device, make = self.buckets[bucket], src_padding_mask.device, self.make
        self.cache = make(bucket.rows, bucket.capacity, device, buffers)
        self.mask = buffers.zeros((bucket.rows, bucket.source), torch.bool, device)  # (n, S) padded
        self.mask[:rows, source:] = True
        self.mask[:rows, :source] = src_padding_mask
        members = memory if isinstance(memory, list) else [memory]
        padded = []
        for member in members:  # (n, S, D) -> (rows, source, D), zeros around
            out = member.new_zeros(bucket.rows, bucket.source, member.shape[-1])
            out[:rows, :source] = member
            padded.append(out)
        self.memory = padded if isinstance(memory, list) else padded[0]

    def compiled_inputs(self) -> tuple[Tensor, Tensor]:
        """At the first compiled step: the fixed-address tokens and flags of the bucket's rows * g
        decoder rows, and which dimensions of the step's tensors vary from bucket to bucket."""
        assert self.bucket is not None and self.cache is not None and self.mask is not None
        if self.tokens is None or self.flags is None:
            buffers, device = self.buckets[self.bucket], self.mask.device
            decoder_rows = self.bucket.rows * self.cache.beams
            self.tokens = buffers.zeros((decoder_rows,), torch.long, device)
            self.flags = buffers.zeros((decoder_rows,), torch.bool, device)
            members = self.memory if isinstance(self.memory, list) else [self.memory]
            inputs = [(self.tokens, (0,)), (self.flags, (0,)), (self.mask, (0, 1))]
            mark_dynamic(inputs + [(member, (0, 1)) for member in members] + _dynamic_dims(self.cache))
        return self.tokens, self.flags

    def select_beams(self, parents: Tensor, sentences: Tensor | None = None) -> None:
        """`StaticDecoderCache.select_beams` for the search's sentences; the padding rows follow beam 0."""
        assert self.bucket is not None and self.cache is not None
        self.cache.select_beams(pad_rows(parents, self.bucket.rows), sentences)

    def __call__(
        self,
        step_fn: Callable[..., Tensor],
        model: Searchable,
        last_tokens: Tensor,
        memory: object,
        src_padding_mask: Tensor,
        rules: StepRules,
        at_max_length: Tensor | None,
        history: Tensor | None,
    ) -> Tensor:
        """One step over the bucket's rows: (N, V) for the search's N = rows * g decoder rows."""
        if self.cache is None:
            self.start(memory, src_padding_mask)
        assert self.bucket is not None and self.cache is not None
        decoder_rows = self.bucket.rows * self.cache.beams
        if step_fn is next_log_probs:  # eager (the first step): padded copies
            tokens, flags = last_tokens.new_zeros(decoder_rows), None
        else:
            tokens, flags = self.compiled_inputs()
        tokens = pad_rows(last_tokens, decoder_rows, tokens)
        flags = None if at_max_length is None else pad_rows(at_max_length, decoder_rows, flags)
        if history is not None and rules.no_repeat_ngram_size:
            history = pad_rows(history, decoder_rows)
        else:
            history = None
        log_probs = step_fn(
            model, tokens, self.memory, self.mask, self.cache, rules, self.cache.offset, flags, history
        )  # (rows * g, V)
        return log_probs[: last_tokens.shape[0]]


def _dynamic_dims(cache: StaticCache | EnsembleCache) -> list[tuple[Tensor, tuple[int, ...]]]:
    """The buffers of a static cache and their dimensions that vary from bucket to bucket: rows n,
    capacity C, source width S, and g beams in beam search (g = 1, greedy, is a graph of its own)."""
    dims: list[tuple[Tensor, tuple[int, ...]]] = []
    for member in cache.caches if isinstance(cache, EnsembleCache) else [cache]:
        dims.append((member.visible, (0, 1, 2) if member.beams > 1 else (0, 2)))  # (n, g, C)
        for layer in member.self_attn:
            dims += [(layer._key, (0, 1)), (layer._value, (0, 1))]  # (C, n, H, Dh)
        for layer in member.cross_attn:
            dims += [(layer._key, (0, 2)), (layer._value, (0, 2))]  # (n, H, S, Dh)
    return dims
