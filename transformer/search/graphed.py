"""The static decoding step as a CUDA graph without a compiler: `next_log_probs` run eagerly once, then
recorded with `torch.cuda.CUDAGraph` at its next call and replayed from then on, one graph per bucket
(`transformer.search.buckets`) and kind of step. It needs what the compiled step needs (the static
cache's fixed shapes and fixed-address `StaticBuffers`, no host read inside the step) but no tracing:
a graph costs one eager step and one recording, milliseconds, where `torch.compile` spends seconds
before its first step. The kernels are the eager step's, unfused.

A graph replays the addresses it was recorded with and freezes every Python value of the step it
recorded. So a graph is keyed by what the step's Python depends on (the model, the step rules, the
beams, autocast), and replayed only while the tensors the step reads from outside keep the addresses
they had at the recording (`_addresses`: the model's parameters and buffers, the bucket's buffers);
otherwise it is recorded again. `graph` makes the recorder: a CUDA graph, or in tests a CPU stand-in
that checks each replay would be the recorded one (tests/unit/test_graphed_step.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from transformer.search.ensemble import EnsembleCache
from transformer.search.step import Searchable, StepRules, next_log_probs

__all__ = ["CudaGraph", "Graph", "GraphedStep"]


class Graph(Protocol):
    """One recorded call."""

    def record(self, fn: Callable[[], Tensor]) -> Tensor:
        """Record `fn` and run it once; its output's memory is rewritten by every replay."""
        ...

    def replay(self, fn: Callable[[], Tensor]) -> None:
        """Run the recording again, standing for the call `fn` (which a CUDA graph does not run)."""
        ...


class CudaGraph:
    """A `torch.cuda.CUDAGraph` of one call, in a memory pool of its own (what it allocates stays its
    own between replays, so a graph's output outlives other graphs' replays)."""

    def __init__(self) -> None:
        self._graph = torch.cuda.CUDAGraph()

    def record(self, fn: Callable[[], Tensor]) -> Tensor:
        with torch.cuda.graph(self._graph):
            output = fn()  # recorded, not run
        self._graph.replay()
        return output

    def replay(self, fn: Callable[[], Tensor]) -> None:
        self._graph.replay()


@dataclass
class _Recorded:
    addresses: tuple[int, ...]  # of the tensors read from outside, when recorded
    graph: Graph
    output: Tensor  # (rows * g, V), rewritten by each replay
    cache: weakref.ref  # the search (its cache) last found at these addresses: no need to look again


class GraphedStep:
    """`next_log_probs` over a `BucketedCache`'s static cache, as a recorded graph (see the module).

    A graph key's first call runs eagerly (the warm-up: kernel choices, workspaces, lazily built
    tables), its second records; later calls replay while the addresses hold (looked at once per
    search). The graphs live on the bucket's `StaticBuffers` (`graphs`), whose addresses they replay,
    and are dropped with them. A step that reads a growing history (n-gram blocking) has no fixed
    shape and runs eagerly.
    """

    def __init__(self, graph: Callable[[], Graph] = CudaGraph) -> None:
        self.graph = graph
        self.recorded = 0  # graphs recorded in all
        self._warmed: set[Hashable] = set()

    def __call__(
        self,
        model: Searchable,
        tokens: Tensor,
        memory: object,
        mask: Tensor,
        cache: object,
        rules: StepRules,
        position: Tensor,
        flags: Tensor | None,
        history: Tensor | None = None,
    ) -> Tensor:
        def step() -> Tensor:
            return next_log_probs(model, tokens, memory, mask, cache, rules, position, flags, history)

        if history is not None:
            return step()
        graphs: dict[Hashable, _Recorded] = _buffers(cache).graphs
        key = _key(model, cache, rules, tokens.device, flags is None)
        held = graphs.get(key)
        if held is None or held.cache() is not cache:  # a new search: has anything it reads moved?
            addresses = _addresses(model, cache, tokens, mask, flags)
            if held is None or held.addresses != addresses:
                if key not in self._warmed:
                    self._warmed.add(key)
                    return step()
                graph = self.graph()
                graphs[key] = _Recorded(addresses, graph, graph.record(step), weakref.ref(cache))
                self.recorded += 1
                return graphs[key].output
            held.cache = weakref.ref(cache)
        held.graph.replay(step)
        return held.output


def _buffers(cache: object) -> object:
    """The `StaticBuffers` of a static cache (one per bucket; an ensemble's members share them)."""
    first = cache.caches[0] if isinstance(cache, EnsembleCache) else cache
    return first.buffers


def _key(
    model: Searchable, cache: object, rules: StepRules, device: torch.device, no_flags: bool
) -> Hashable:
    """What the step's Python depends on, besides the shapes of the bucket: the model (a weak reference:
    a new model at a freed one's addresses is another key), the rules, the beams per row, autocast."""
    autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)
    return (weakref.ref(model), rules, cache.beams, no_flags, autocast)


def _addresses(model: Searchable, cache: object, *inputs: Tensor | None) -> tuple[int, ...]:
    """The addresses of everything the step reads from outside: the model's parameters and buffers, the
    step's inputs, and each static cache's buffers (its memory projections included)."""
    return tuple(t.data_ptr() for t in _read_from_outside(model, cache, inputs))


def _read_from_outside(
    model: Searchable, cache: object, inputs: tuple[Tensor | None, ...]
) -> Iterator[Tensor]:
    yield from model.parameters()
    yield from model.buffers()
    yield from (t for t in inputs if t is not None)
    for member in cache.caches if isinstance(cache, EnsembleCache) else [cache]:
        yield from (member.visible, member.cursor, member.position)
        for layer in (*member.self_attn, *member.cross_attn):
            yield from (layer._key, layer._value)
