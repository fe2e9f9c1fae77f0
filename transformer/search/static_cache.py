"""The static KV cache: decoder self-attention keys and values in buffers preallocated at the search's
maximum length, so that every decoding step after the first has the same tensor shapes whatever the
step number (the condition for one compiled graph, or one CUDA graph, serving every step); and
`Stepping`, how a search runs its steps: over the growing cache, the static one, or the static one
with the step recorded as CUDA graphs (`transformer.search.graphed`) or compiled
(`transformer.search.compiled`), over caches padded to shape buckets (`transformer.search.buckets`: one
CUDA graph per bucket and kind of step; two compilations); `DecodingSettings.kv_cache` chooses.

`StaticDecoderCache` has the interface of `DecoderCache` (the decoder and the searches use either),
with three differences: rows never leave (finished ones are masked by the search instead), the
position of the step is a device tensor owned by the search, and each step's queries attend to all
C slots of the buffer under a visibility mask (n, g, C) that says which slots form each row's
prefix (g = the beams of a sentence sharing a cache row, 1 outside beam search). `StaticBuffers` keeps
their storage from one search to the next, so that a CUDA graph recorded once keeps being replayed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from transformer.kernels import RotaryLike
from transformer.kv_cache import KVCache, _at_position
from transformer.search.buckets import BucketCache, BucketedCache
from transformer.search.compiled import compile_step
from transformer.search.ensemble import Ensemble, EnsembleCache
from transformer.search.graphed import GraphedStep
from transformer.search.step import Searchable, StepRules, next_log_probs

__all__ = [
    "StaticBuffers",
    "StaticDecoderCache",
    "StaticKVCache",
    "Stepping",
    "compile_step",
    "graphed_step",
    "new_static_cache",
    "static_capacity",
]


def static_capacity(longest: int, beam_size: int) -> int:
    """Self-attention slots per cache row for hypotheses of up to `longest` tokens: BOS, then one key per
    step and beam (the last token is never fed back), rounded up to KVCache.BLOCK so that batches of
    nearby lengths share one shape (one compiled graph)."""
    slots = 1 + max(longest - 1, 0) * beam_size
    return -(-slots // KVCache.BLOCK) * KVCache.BLOCK


class StaticBuffers:
    """Zero-filled tensors for the static caches of successive searches, at fixed addresses.

    CUDA graphs replay on the addresses they were recorded with, and inductor's cudagraph trees record
    again whenever an input marked static (`torch._dynamo.mark_static_address`) comes at a new one. So
    the i-th tensor a search asks for is a view at the start of the same storage as the i-th of the
    search before (the order is fixed: layers, then ensemble members), reallocated (at least doubled)
    only when too small: a search of the same shapes replays the graph recorded by an earlier one.
    The storage of the largest search stays allocated between searches; one search at a time.
    `None` instead of a `StaticBuffers` allocates afresh (eager static searches). `graphs`: the CUDA
    graphs recorded over these buffers (`transformer.search.graphed`), which live and die with them.
    """

    def __init__(self) -> None:
        self._storage: list[Tensor] = []
        self._taken = 0
        self.graphs: dict[Hashable, Any] = {}

    def start(self) -> None:
        """A new search: hand out the storage from the first one again."""
        self._taken = 0

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = math.prod(shape)
        index, self._taken = self._taken, self._taken + 1
        held = self._storage[index] if index < len(self._storage) else None
        if held is None or held.dtype != dtype or held.device != device or held.numel() < numel:
            grown = max(numel, 2 * held.numel()) if held is not None and held.dtype == dtype else numel
            held = torch.empty(grown, dtype=dtype, device=device)
            if index < len(self._storage):
                self._storage[index] = held
            else:
                self._storage.append(held)
        view = held[:numel].view(shape).zero_()
        torch._dynamo.mark_static_address(view)  # written in place: one address for CUDA graphs
        return view


def _zeros(
    buffers: StaticBuffers | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> Tensor:
    if buffers is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return buffers.zeros(shape, dtype, device)


class StaticKVCache:
    """One decoder self-attention layer's keys and values in (C, n, H, Dh) position-major buffers of
    fixed capacity C, zero-filled (a masked slot then weighs 0 times a finite value, never NaN).

    The first update (the search's first step, run eagerly) allocates the buffers in the dtype the keys
    come in (autocast included), writes them at slots 0 .. g-1 and returns only those, like `KVCache`.
    Every later update writes its g new keys per row at `slots` ((g,) long on the device, set by
    `StaticDecoderCache.start_step`) with `index_copy_` and returns all C slots; `len()` is then C - g,
    the number of keys `MultiHeadAttention` counts before the new ones, so that it expects masks over C.
    """

    static = False  # an appending self-attention cache, in `MultiHeadAttention`'s terms

    def __init__(self, capacity: int, buffers: StaticBuffers | None = None) -> None:
        self.capacity = capacity
        self.buffers = buffers
        self._key: Tensor | None = None  # (C, n, H, Dh)
        self._value: Tensor | None = None
        self._first = 0  # keys the first step wrote (returned alone by that step)
        self.slots: Tensor | None = None  # (g,) long: where this step's new keys go
        self.new = 1  # g: new keys per row this step

    @property
    def key(self) -> Tensor | None:
        """(n, H, C, Dh) every slot (unwritten ones hold zeros), or None before the first step."""
        return None if self._key is None else self._key.permute(1, 2, 0, 3)

    @property
    def value(self) -> Tensor | None:
        """(n, H, C, Dh), like `key`."""
        return None if self._value is None else self._value.permute(1, 2, 0, 3)

    def __len__(self) -> int:
        # from the buffer's shape, not `capacity`: a dynamic dimension of the compiled step, not a constant
        return 0 if self._key is None else self._key.shape[0] - self.new

    def __repr__(self) -> str:
        shape = None if self.key is None else tuple(self.key.shape)
        return f"StaticKVCache(capacity={self.capacity}, key_shape={shape})"

    def reorder(self, index: Tensor) -> None:
        raise RuntimeError("a static KV cache keeps its rows; beams move through the visibility mask")

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Write new (n, H, g, Dh) keys/values; return the first step's (n, H, g, Dh), later all C."""
        new_key, new_value = key.permute(2, 0, 1, 3), value.permute(2, 0, 1, 3)  # (g, n, H, Dh)
        if self._key is None or self._value is None:
            shape = (self.capacity, *new_key.shape[1:])  # (C, n, H, Dh)
            self._key = _zeros(self.buffers, shape, new_key.dtype, new_key.device)
            self._value = _zeros(self.buffers, shape, new_value.dtype, new_value.device)
            self._first = key.shape[2]
            self._key[: self._first] = new_key
            self._value[: self._first] = new_value
            return self._key[: self._first].permute(1, 2, 0, 3), self._value[: self._first].permute(
                1, 2, 0, 3
            )
        assert self.slots is not None, "StaticDecoderCache.start_step sets the slots"
        self._key.index_copy_(0, self.slots, new_key)
        self._value.index_copy_(0, self.slots, new_value)
        return self.key, self.value  # (n, H, C, Dh)


class _MemoryKVCache(KVCache):
    """The cross-attention cache of a `StaticDecoderCache`: a `KVCache(static=True)` whose memory
    projections (made once, at the first step) are copied into `StaticBuffers`, fixed-address inputs
    that a CUDA graph replay reads in place."""

    def __init__(self, buffers: StaticBuffers | None) -> None:
        super().__init__(static=True)
        self.buffers = buffers

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if self.buffers is not None:
            key = self.buffers.zeros(tuple(key.shape), key.dtype, key.device).copy_(key)  # (n, H, S, Dh)
            value = self.buffers.zeros(tuple(value.shape), value.dtype, value.device).copy_(value)
        return super().update(key, value)

    def __len__(self) -> int:
        return 0 if self._key is None else self._key.shape[2]  # S: a dynamic dimension, like C above


class StaticDecoderCache:
    """Incremental-decoding state of a `Decoder` with fixed shapes: per layer a `StaticKVCache` and a
    cross-attention cache, `rows` cache rows of `capacity` slots each, and `visible` (rows, g, C) bool,
    True where a slot belongs to the prefix of the row's beam (its own new key included).

    `position` (0-dim long on the device) is the target position of the next step; the search owns it
    and advances it in place after each step (it is also the step count of the step rules). The first
    step runs like `DecoderCache`'s (one key per row at slot 0, attended alone); from the second on,
    `start_step` writes the step's keys at the slots after the ones used, and attention reads all C.
    `select_beams(parents)` gathers the visibility mask (the beam layout of `DecoderCache`, without
    ever dropping a sentence); `reorder` is refused: rows stay, whatever finishes.
    """

    def __init__(
        self, n_layers: int, rows: int, capacity: int, position: Tensor, buffers: StaticBuffers | None = None
    ) -> None:
        self.self_attn = [StaticKVCache(capacity, buffers) for _ in range(n_layers)]
        self.cross_attn: list[KVCache] = [_MemoryKVCache(buffers) for _ in range(n_layers)]
        self.position = position
        self.buffers = buffers
        device = position.device
        self.visible = _zeros(buffers, (rows, 1, capacity), torch.bool, device)  # (n, g, C)
        self.visible[:, :, 0] = True  # BOS, which the first step writes at slot 0
        self.cursor = _zeros(buffers, (), torch.long, device).add_(1)  # the first free slot

    @property
    def beams(self) -> int:
        """g: decoder rows per cache row."""
        return self.visible.shape[1]

    @property
    def offset(self) -> Tensor:
        """The position of the step about to run, (0-dim long) on the device."""
        return self.position

    def reserve(self, keys: int) -> None:
        if keys > self.self_attn[0].capacity:
            raise ValueError(f"a static cache of {self.self_attn[0].capacity} slots cannot hold {keys} keys")

    def reorder(self, index: Tensor, memory_index: Tensor | None = None) -> None:
        raise RuntimeError("a static DecoderCache keeps its rows: the search masks finished ones instead")

    def select_beams(self, parents: Tensor, sentences: Tensor | None = None) -> None:
        """New beam j of sentence i extends beam `parents[i, j]` ((n, g') long): its visibility row is its
        parent's. In place once the beam count is fixed (the buffer keeps its address); `sentences` must
        be None (no sentence leaves a static cache)."""
        if sentences is not None:
            raise RuntimeError("a static DecoderCache keeps every sentence: the search masks done ones")
        chosen = self.visible.gather(1, parents.unsqueeze(-1).expand(-1, -1, self.visible.shape[-1]))
        if chosen.shape == self.visible.shape:
            self.visible.copy_(chosen)
        else:  # the first step's one beam becomes g
            self.visible = _zeros(self.buffers, tuple(chosen.shape), torch.bool, chosen.device).copy_(chosen)

    def memory_mask(self, padding_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
        """The source padding mask as given, every step (a fixed-address input of the compiled step, in
        which the compiler fuses its conversion into the attention's)."""
        return padding_mask

    def start_step(
        self, length: int, heads: int, rotary: RotaryLike | None, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor | None, RotaryLike | None]:
        """Begin a decoder pass over one new position: (the (n * heads, g, C) bool self-attention mask,
        True = masked, and the rotary at `position`); (None, rotary) at the first step. The mask stays
        boolean whatever `dtype` (built from the fixed-address `visible` inside the compiled step)."""
        if length != 1:
            raise ValueError(f"a StaticDecoderCache takes one position per step, got {length}")
        if self.self_attn[0].key is None:  # the first step: the buffers are allocated by its keys
            return None, rotary
        rows, beams, capacity = self.visible.shape
        slots = self.cursor + torch.arange(beams, device=self.cursor.device)  # (g,) beam j's new key
        self.cursor.add_(beams)
        self.visible.scatter_(2, slots.view(1, beams, 1).expand(rows, beams, 1), True)  # (n, g, C)
        for cache in self.self_attn:
            cache.slots, cache.new = slots, beams
        masked = (~self.visible).unsqueeze(1).expand(-1, heads, -1, -1)  # (n, H, g, C)
        rotary = None if rotary is None else _at_position(rotary, self.position)
        return masked.reshape(rows * heads, beams, capacity), rotary


def new_static_cache(
    model: object, rows: int, capacity: int, device: torch.device, buffers: StaticBuffers | None = None
) -> StaticDecoderCache | EnsembleCache:
    """A static cache for `model` (a `Seq2SeqTransformer`, or an `Ensemble`: one per member, sharing one
    position): `rows` cache rows (sentences) of `capacity` self-attention slots. Its `offset` is the
    step's position (0-dim long, 0), which the search advances in place after each step."""
    if buffers is not None:
        buffers.start()
    position = _zeros(buffers, (), torch.long, device)
    members = model.models if isinstance(model, Ensemble) else [model]
    caches = [
        StaticDecoderCache(len(member.decoder.layers), rows, capacity, position, buffers)
        for member in members
    ]
    return EnsembleCache(caches) if isinstance(model, Ensemble) else caches[0]


@dataclass(frozen=True)
class Stepping:
    """How a search runs its steps: over the growing `DecoderCache`, rows leaving the batch as they
    finish (`static=False`), or over a `StaticDecoderCache` whose rows stay, finished ones masked, so
    that every step after the first has the same shapes; `step` is `next_log_probs` or (static only) a
    compiled version of it, which runs over `BucketedCache`s (shapes padded to `buckets`, each bucket's
    buffers kept from search to search). The first step of a static search runs `next_log_probs`
    eagerly: it fills the cross-attention caches and, in beam search, has one beam per sentence, so its
    graph is not the later steps'."""

    static: bool = False
    step: Callable[..., Tensor] = next_log_probs
    buckets: BucketCache[StaticBuffers] | None = None

    @classmethod
    def of(cls, kv_cache: str, device: torch.device, growing: bool = False) -> Stepping:
        """`DecodingSettings.kv_cache` on `device`. "auto" is "graphed" on CUDA and "dynamic" elsewhere,
        or wherever the search needs the growing cache (`growing`: prefixes and constraints, whose
        bookkeeping follows its rows, and n-gram blocking, whose history has no fixed shape); why: see
        `DecodingSettings`."""
        if kv_cache == "auto":
            kv_cache = "graphed" if device.type == "cuda" and not growing else "dynamic"
        if kv_cache == "dynamic":
            return cls()
        if kv_cache == "static":
            return cls(static=True)
        if kv_cache == "graphed":
            if device.type != "cuda":
                raise ValueError(
                    f"decode.kv_cache=graphed records CUDA graphs and needs a CUDA device, not "
                    f"{device.type}; use decode.kv_cache=auto (dynamic there)"
                )
            return cls(static=True, step=graphed_step(), buckets=_bucket_buffers())
        return cls(static=True, step=compile_step(device), buckets=_bucket_buffers())

    def new_cache(
        self, model: Searchable, rows: int, longest: int, beam_size: int, device: torch.device
    ) -> object:
        """A search's cache: `rows` rows (sentences) of up to `longest` tokens, `beam_size` beams each."""
        if self.buckets is not None:
            make = functools.partial(new_static_cache, model)
            return BucketedCache(make, rows, static_capacity(longest, beam_size), beam_size, self.buckets)
        if self.static:
            return new_static_cache(model, rows, static_capacity(longest, beam_size), device)
        cache = model.new_cache()
        cache.reserve(1 + (longest - 1) * beam_size)  # BOS, then one key per step and beam
        return cache

    def __call__(
        self,
        step: int,
        model: Searchable,
        last_tokens: Tensor,
        memory: object,
        src_padding_mask: Tensor,
        cache: object,
        rules: StepRules,
        at_max_length: Tensor | None,
        history: Tensor | None,
    ) -> Tensor:
        """The search's step number `step` (`next_log_probs`' arguments): in a static search the step
        count is the cache's position on the device, the same tensor at every step."""
        if not self.static:
            return next_log_probs(
                model, last_tokens, memory, src_padding_mask, cache, rules, step, at_max_length, history
            )
        step_fn = self.step if step else next_log_probs
        if isinstance(cache, BucketedCache):
            return cache(step_fn, model, last_tokens, memory, src_padding_mask, rules, at_max_length, history)
        return step_fn(
            model, last_tokens, memory, src_padding_mask, cache, rules, cache.offset, at_max_length, history
        )

    def advance(self, cache: object) -> None:
        """After a step: a static cache's position moves on (a dynamic one counts its own keys)."""
        if self.static:
            cache.offset.add_(1)


@functools.cache
def graphed_step() -> GraphedStep:
    """The process's graphed step (`decode.kv_cache=graphed`): one, so that its warm-ups and graphs
    serve every search of the process."""
    return GraphedStep()


@functools.cache
def _bucket_buffers() -> BucketCache[StaticBuffers]:
    """The graphed and compiled steps' cache storage, one `StaticBuffers` per bucket, process-wide like
    the steps themselves (a graph replays its bucket's addresses)."""
    return BucketCache(StaticBuffers)
