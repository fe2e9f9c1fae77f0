"""The static step as a recorded graph without a compiler (`transformer.search.graphed`), checked on the CPU
with a stand-in for CUDA graphs, `ReplayCheck`: it records the operations of the recorded call (each with
its Python arguments, and where each tensor comes from: made in the call, or read from outside at an
address), and at every replay runs the call it stands for and fails unless those operations are the
recorded ones. A CUDA graph replays the recording, so equal operations mean the replay computes what the
eager step would: no Python value of a later step differs from the recording's, and nothing read from
outside has moved. The searches then give the eager static cache's tokens and scores exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import transformer.search.graphed as graphed
import transformer.search.static_cache as static_cache
from tests.helpers.syncs import syncs_per_step
from tests.helpers.tiny import tiny_seq2seq, tiny_sources
from transformer.search.buckets import BucketedCache
from transformer.search.decoding import DecodingSettings, search
from transformer.search.ensemble import Ensemble
from transformer.search.graphed import GraphedStep
from transformer.search.step import next_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 24


class _Trace(TorchDispatchMode):
    """The operations of one call: name, then each argument as it would be frozen in a graph (a Python
    value as it is; a tensor as ("made", k), the k-th one the call made, or ("outside", address, shape,
    strides, dtype))."""

    def __init__(self) -> None:
        super().__init__()
        self.operations: list[tuple[Any, ...]] = []
        self._made: dict[int, int] = {}
        self._kept: list[Tensor] = []  # so that no id is reused within the call

    def _frozen(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            made = self._made.get(id(value))
            if made is not None:
                return ("made", made)
            return ("outside", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
        if isinstance(value, (list, tuple)):
            return tuple([self._frozen(item) for item in value])
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten.lift_fresh:  # a Python number made a CPU tensor (x[i] = v)
            self.operations.append((str(func), ("scalar", args[0].item())))
            return self._keep(func(*args, **kwargs))
        frozen_kwargs = tuple((key, self._frozen(kwargs[key])) for key in sorted(kwargs))
        self.operations.append((str(func), self._frozen(args), frozen_kwargs))
        return self._keep(func(*args, **kwargs))

    def _keep(self, out: Any) -> Any:
        for tensor in (out,) if isinstance(out, Tensor) else tree_flatten(out)[0]:
            if isinstance(tensor, Tensor) and id(tensor) not in self._made:
                self._made[id(tensor)] = len(self._kept)
                self._kept.append(tensor)
        return out


def _traced(fn: Callable[[], Tensor]) -> tuple[list[tuple[Any, ...]], Tensor]:
    with _Trace() as trace:
        output = fn()
    return trace.operations, output


class ReplayCheck:
    """The CPU's CUDA graph (see the module): `record` runs the call and keeps its operations; `replay`
    runs the call it stands for, checks its operations are the recorded ones, and writes its output into
    the recorded output, as a graph replay rewrites it."""

    replays = 0  # in all, over every instance

    def record(self, fn: Callable[[], Tensor]) -> Tensor:
        self.operations, self.output = _traced(fn)
        return self.output

    def replay(self, fn: Callable[[], Tensor]) -> None:
        operations, output = _traced(fn)
        assert len(operations) == len(self.operations), "a replay runs other operations than recorded"
        for recorded, now in zip(self.operations, operations):
            assert now == recorded, f"replayed {recorded}\nbut the step now runs {now}"
        self.output.copy_(output)
        ReplayCheck.replays += 1


@pytest.fixture
def checked_graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[GraphedStep]:
    """kv_cache=compiled with its step a `GraphedStep` over `ReplayCheck`s, on fresh bucket buffers."""
    step = GraphedStep(ReplayCheck)
    monkeypatch.setattr(static_cache, "compile_step", lambda device: step)
    static_cache._bucket_buffers.cache_clear()
    ReplayCheck.replays = 0
    yield step
    static_cache._bucket_buffers.cache_clear()


def _model(seed: int, **overrides: Any) -> Any:
    return tiny_seq2seq(seed, vocab=VOCAB, **overrides)


def _decode(model: Any, src: Tensor, kv_cache: str, **settings: Any) -> tuple[Tensor, Tensor]:
    settings = {"max_len_b": 20, **settings}
    return search(
        model, src, DecodingSettings(kv_cache=kv_cache, **settings), torch.Generator().manual_seed(7)
    )


def _eager(model: Any, src: Tensor, **settings: Any) -> tuple[Tensor, Tensor]:
    """kv_cache=compiled with the eager step: the same buckets (padded rows, slots), the same sums."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static_cache, "compile_step", lambda device: next_log_probs)
        return _decode(model, src, "compiled", **settings)


def _assert_equal(expected: tuple[Tensor, Tensor], got: tuple[Tensor, Tensor]) -> None:
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


SEARCHES = {
    "greedy": {"beam_size": 1},
    "beam4_nbest": {"beam_size": 4, "n_best": 4},
    "sample": {"search": "sample", "top_k": 5, "top_p": 0.9, "n_best": 2},
    "min_len_beam": {"beam_size": 4, "min_len": 3},
}


@pytest.mark.parametrize("name", list(SEARCHES))
def test_graphed_step_replays_what_the_eager_step_runs(checked_graphs: GraphedStep, name: str) -> None:
    """Three searches of one bucket: the first step eager, then a warm-up (eager), a recording, replays;
    the later searches replay from their first graphed step, each replay checked. The same tokens and
    scores as the eager step over the same buckets, exactly (the same operations)."""
    model, src = _model(0), tiny_sources(12, vocab=VOCAB)
    eager = _eager(model, src, **SEARCHES[name])
    assert eager[0].shape[-1] > 5 and eager[0].eq(0).any(), "sentences should end at different lengths"
    for _ in range(3):
        _assert_equal(eager, _decode(model, src, "compiled", **SEARCHES[name]))
    assert checked_graphs.recorded == 1
    assert ReplayCheck.replays >= 3 * (eager[0].shape[-1] - 3)


@pytest.mark.usefixtures("cuda_path")
@pytest.mark.parametrize("beam_size", [1, 4])
def test_graphed_step_on_the_cuda_code_path(checked_graphs: GraphedStep, beam_size: int) -> None:
    """The kernels' CUDA choices (the `cuda_path` fixture: the masks and SDPA calls a GPU runs)."""
    model, src = _model(0), tiny_sources(12, vocab=VOCAB)
    eager = _eager(model, src, beam_size=beam_size)
    for _ in range(2):
        _assert_equal(eager, _decode(model, src, "compiled", beam_size=beam_size))
    assert checked_graphs.recorded == 1 and ReplayCheck.replays > 10


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("overrides", [{"positional": "rope"}, {"positional": "learned", "norm_first": True}])
def test_graphed_step_of_every_position_kind_and_an_ensemble(
    checked_graphs: GraphedStep, overrides: dict[str, Any], beam_size: int
) -> None:
    ensemble = Ensemble([_model(0, **overrides), _model(1, d_model=16, layers=1)])
    for model in (_model(2, **overrides), ensemble):
        src = tiny_sources(6, vocab=VOCAB, seed=1)
        eager = _eager(model, src, beam_size=beam_size)
        for _ in range(2):
            _assert_equal(eager, _decode(model, src, "compiled", beam_size=beam_size))
    assert checked_graphs.recorded == 2 and ReplayCheck.replays > 10


def test_one_graph_per_bucket_and_model_recorded_again_when_an_address_moves(
    checked_graphs: GraphedStep,
) -> None:
    """Other sentences in the same bucket replay; another bucket, model or step rules record their own
    graph; a parameter at a new address (as after `load_state_dict` into new tensors) records again."""
    model, other = _model(0), _model(3)
    batches = [tiny_sources(12, vocab=VOCAB, seed=seed) for seed in range(3)] + [tiny_sources(3, vocab=VOCAB)]
    for decoder in (model, other):
        for src in batches:
            _assert_equal(_eager(decoder, src), _decode(decoder, src, "compiled"))
    assert checked_graphs.recorded == 4  # 2 buckets (16 and 4 rows) x 2 models
    for _ in range(2):  # other step rules: other Python values in the step
        _assert_equal(_eager(model, batches[0], min_len=3), _decode(model, batches[0], "compiled", min_len=3))
    assert checked_graphs.recorded == 5
    weight = model.decoder.layers[0].feed_forward.linear1.weight
    weight.data = weight.data.clone()  # same values, a new address
    _assert_equal(_eager(model, batches[0]), _decode(model, batches[0], "compiled"))
    assert checked_graphs.recorded == 6


def test_the_check_catches_a_step_that_a_graph_would_not_replay(
    checked_graphs: GraphedStep, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in is not lenient: a step whose Python value changes from step to step (frozen in a
    graph), or an input at a new address every step (a graph reads the recorded one), fails."""
    model, src = _model(0), tiny_sources(8, vocab=VOCAB)
    step_fn = graphed.next_log_probs
    calls = [0]

    def counting(*args: Any) -> Tensor:
        calls[0] += 1
        return step_fn(*args) - 1e-9 * calls[0]  # a Python number that changes

    monkeypatch.setattr(graphed, "next_log_probs", counting)
    with pytest.raises(AssertionError, match="the step now runs"):
        _decode(model, src, "compiled")

    monkeypatch.setattr(graphed, "next_log_probs", step_fn)
    inputs = BucketedCache.compiled_inputs

    def moving(self: BucketedCache) -> tuple[Tensor, Tensor]:
        tokens, flags = inputs(self)
        return tokens.clone(), flags  # the tokens at a new address every step, not the bucket's

    monkeypatch.setattr(BucketedCache, "compiled_inputs", moving)
    with pytest.raises(AssertionError, match="the step now runs"):
        _decode(model, src, "compiled")


def test_graphed_step_reads_back_nothing_more(checked_graphs: GraphedStep) -> None:
    """Still one host read per step: the graph's bookkeeping reads addresses, never the device."""
    model = _model(0)
    model.pack_tokens = False  # the GPU's encoder path, as in test_decoding_syncs
    for _ in range(2):
        per_step = syncs_per_step(
            model, tiny_sources(16, vocab=VOCAB), DecodingSettings(max_len_b=20, kv_cache="compiled")
        )
        assert len(per_step) > 6 and set(per_step[1:-1]) == {1}, per_step


def test_a_growing_history_runs_eagerly() -> None:
    """n-gram blocking reads the hypotheses so far, one column more each step: no graph."""
    model, src = _model(0), tiny_sources(4, vocab=VOCAB)
    step = GraphedStep(ReplayCheck)
    cache = static_cache.new_static_cache(model, 4, 16, src.device, static_cache.StaticBuffers())
    memory, mask = model.encode(src), model.padding_mask(src)
    rules = DecodingSettings(no_repeat_ngram_size=2).rules(model)
    tokens = torch.full((4,), model.config.bos_id)
    with torch.no_grad():
        for length in range(1, 4):
            history = torch.full((4, length), model.config.bos_id)
            step(model, tokens, memory, mask, cache, rules, cache.offset, None, history)
            cache.offset.add_(1)
    assert step.recorded == 0
