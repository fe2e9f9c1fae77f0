"""The static KV cache (`decode.kv_cache=static|compiled`, `transformer.search.static_cache`): the same tokens
and scores as the growing cache for every search, fixed shapes that compile to one graph with no graph break
and no recompilation from step to step, and no more host reads per step. Compiled with the cheap
`aot_eager` backend (functionalizes the in-place cache writes as inductor would, without generating code);
the ensemble's one-shape search with Dynamo's `eager` backend (its members' writes are the single model's)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import transformer.search.static_cache as static_cache
from tests.helpers.static_decoding import (
    SEARCHES,
    assert_same,
    decoded,
    fresh_compilation,
    seq2seq,
    sources,
    widen,
)
from tests.helpers.syncs import syncs_per_step
from transformer.search.compiled import compile_step
from transformer.search.constraints import TargetRequest
from transformer.search.decoding import DecodingSettings, search
from transformer.search.ensemble import Ensemble
from transformer.search.graphed import GraphedStep
from transformer.search.static_cache import (
    StaticBuffers,
    StaticDecoderCache,
    new_static_cache,
    static_capacity,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def aot_eager_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """kv_cache=compiled compiles with aot_eager (fullgraph: a graph break fails the search), from a
    clean Dynamo cache and fresh bucket buffers, and counts the graphs in
    `counters["stats"]["unique_graphs"]`."""
    monkeypatch.setattr(static_cache, "compile_step", lambda device: compile_step(device, "aot_eager"))
    fresh_compilation()
    counters.clear()
    yield
    fresh_compilation()


@pytest.mark.parametrize("name", list(SEARCHES))
def test_static_cache_decodes_what_the_growing_cache_decodes(name: str) -> None:
    model, src = seq2seq(0), sources(12)
    dynamic = decoded(model, src, "dynamic", **SEARCHES[name])
    assert dynamic[0].shape[-1] > 5 and dynamic[0].eq(0).any(), "sentences should end at different lengths"
    assert_same(dynamic, decoded(model, src, "static", **SEARCHES[name]))


@pytest.mark.parametrize(
    "overrides", [{"positional": "learned"}, {"positional": "rope"}, {"norm_first": True}], ids=str
)
@pytest.mark.parametrize("beam_size", [1, 4])
def test_static_cache_with_every_position_kind(overrides: dict[str, Any], beam_size: int) -> None:
    """Tensor positions through learned positions and rotary (in the beam layout too)."""
    model, src = seq2seq(1, **overrides), sources(6, seed=1)
    assert_same(
        decoded(model, src, "dynamic", beam_size=beam_size),
        decoded(model, src, "static", beam_size=beam_size),
    )


@pytest.mark.parametrize("beam_size", [1, 4])
def test_static_cache_decodes_an_ensemble_alike(beam_size: int) -> None:
    ensemble = Ensemble([seq2seq(0), seq2seq(1, d_model=16, layers=1)])
    src = sources(8, seed=2)
    assert_same(
        decoded(ensemble, src, "dynamic", beam_size=beam_size),
        decoded(ensemble, src, "static", beam_size=beam_size),
    )


@pytest.mark.parametrize(
    "settings",
    [
        {"max_len_a": 0, "max_len_b": 1, "beam_size": 4},  # one step: the eager first one only
        {"max_len_a": 0, "max_len_b": 2, "search": "sample", "n_best": 3},
        {"beam_size": 4, "length_penalty": 0.0, "n_best": 2},
        {"beam_size": 30, "n_best": 30},  # more candidates than the vocabulary holds: dead beams
    ],
    ids=str,
)
def test_static_cache_at_the_edges(settings: dict[str, Any]) -> None:
    model, src = seq2seq(0), sources(7, seed=3)
    assert_same(decoded(model, src, "dynamic", **settings), decoded(model, src, "static", **settings))
    assert decoded(model, src[:0], "static", **settings)[0].shape[0] == 0


@pytest.mark.usefixtures("aot_eager_step")
@pytest.mark.parametrize("name", ["greedy", "beam4_nbest", "sample"])
def test_compiled_step_is_one_graph_for_every_step(name: str) -> None:
    """fullgraph (no graph break); one graph for all steps after the first (eager) one, and a second
    search of the same shapes compiles nothing (error_on_recompile)."""
    model, src = seq2seq(0), sources(12)
    settings = {**SEARCHES[name], "min_len": 2}  # the min_len rule on the device too
    dynamic = decoded(model, src, "dynamic", **settings)
    assert_same(dynamic, decoded(model, src, "compiled", **settings))
    assert counters["stats"]["unique_graphs"] == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert_same(dynamic, decoded(model, src, "compiled", **settings))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.usefixtures("aot_eager_step")
def test_compiled_step_of_an_ensemble_is_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Traced with Dynamo's `eager` backend (half the time of aot_eager): one graph and the growing cache's
    outputs are Dynamo's doing, and the members' cache writes are the single model's, functionalized by
    aot_eager in test_compiled_step_is_one_graph_for_every_step[beam4_nbest]; one batch shape, so no size
    guard that aot_eager's tracing could add is ever tested."""
    monkeypatch.setattr(static_cache, "compile_step", lambda device: compile_step(device, "eager"))
    ensemble = Ensemble([seq2seq(0), seq2seq(1, d_model=16, layers=1)])
    src = sources(8, seed=2)
    assert_same(
        decoded(ensemble, src, "dynamic", beam_size=4), decoded(ensemble, src, "compiled", beam_size=4)
    )
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.usefixtures("aot_eager_step")
def test_compiled_step_over_batches_of_other_shapes() -> None:
    """Batches of other sizes (other row buckets: 8, 4, 16) reuse the one graph, whose rows are a
    dynamic dimension from the start: the outputs stay the growing cache's."""
    model = seq2seq(2, d_model=16, layers=1)
    for batch in (6, 3, 9):
        src = sources(batch, seed=batch)
        assert_same(decoded(model, src, "dynamic"), decoded(model, src, "compiled"))
        assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.usefixtures("aot_eager_step")
def test_compiled_decoding_compiles_at_most_twice() -> None:
    """Beam 4 and greedy alternating over two source widths (buckets 16, 64) and two batch sizes
    (buckets 4, 16) in one process: at most 2 compilations, greedy's and beam search's (every size a
    dynamic dimension of their graphs), and every sentence decodes as with the growing cache.
    Without buckets and dynamic dimensions this compiled 6 times."""
    model = seq2seq(2, d_model=16, layers=1)
    for batch, width in ((3, 14), (10, 40), (3, 40), (10, 14)):
        src = widen(sources(batch, seed=batch + width), width)
        for settings in ({"beam_size": 4, "n_best": 2}, {"beam_size": 1}):
            assert_same(
                decoded(model, src, "dynamic", **settings), decoded(model, src, "compiled", **settings)
            )
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize("name", ["greedy", "beam4_nbest", "sample", "constrained_beam"])
def test_static_cache_reads_back_one_value_per_step(name: str) -> None:
    """Fixed rows do not cost host reads: still exactly one per step (tests/helpers/syncs.py counts)."""
    model = seq2seq(0)
    model.pack_tokens = False  # the GPU's encoder path, as in test_decoding_syncs
    per_step = syncs_per_step(
        model, sources(16), DecodingSettings(max_len_b=20, kv_cache="static", **SEARCHES[name])
    )
    assert len(per_step) > 6 and set(per_step[1:-1]) == {1}, per_step
    assert per_step[0] == 1 and per_step[-1] <= 2, per_step


def test_static_cache_shapes_do_not_change_with_the_step() -> None:
    """Every step after the first reads the same (n, H, C, Dh) buffers and an (n * H, g, C) mask."""
    model, src = seq2seq(0), sources(4)
    position = torch.zeros((), dtype=torch.long)
    capacity = static_capacity(12, 1)
    assert capacity == 16  # rounded up to KVCache.BLOCK
    cache = StaticDecoderCache(len(model.decoder.layers), 4, capacity, position)
    memory, mask = model.encode(src), model.padding_mask(src)
    shapes, tokens = set(), torch.full((4,), model.config.bos_id)
    with torch.no_grad():
        for _ in range(6):
            logits = model.decode(tokens.unsqueeze(1), memory, mask, cache)[:, -1]
            tokens = logits.argmax(-1)
            position.add_(1)
            key = cache.self_attn[0].key
            shapes.add((tuple(key.shape), tuple(cache.visible.shape)))
    assert shapes == {((4, 4, capacity, 8), (4, 1, capacity))}
    assert cache.visible[:, 0].sum(-1).tolist() == [6] * 4  # BOS and 5 fed-back tokens visible
    with pytest.raises(RuntimeError, match="keeps its rows"):
        cache.reorder(torch.tensor([0, 1]))


def _steps(
    model: Any, src: torch.Tensor, buffers: StaticBuffers, steps: int = 3
) -> tuple[list[int], torch.Tensor]:
    """`steps` greedy steps over a static cache from `buffers` -> (addresses of its tensors, last logits)."""
    cache = new_static_cache(model, src.size(0), 16, src.device, buffers)
    memory, mask = model.encode(src), model.padding_mask(src)
    tokens = torch.full((src.size(0),), 1)
    with torch.no_grad():
        for _ in range(steps):
            logits = model.decode(tokens.unsqueeze(1), memory, mask, cache)[:, -1]
            tokens = logits.argmax(-1)
            cache.offset.add_(1)
    caches = cache.caches if isinstance(model, Ensemble) else [cache]
    tensors = [t for c in caches for t in (c.self_attn[0]._key, c.cross_attn[-1].value, c.visible, c.cursor)]
    return [t.data_ptr() for t in (*tensors, cache.offset)], logits


def test_static_buffers_keep_their_addresses_from_search_to_search() -> None:
    """What CUDA graphs need to replay: the same tensors at the same addresses for every search of the
    same shapes, zeroed in between (no state leaks into the next search); two ensemble members apart."""
    model, buffers = seq2seq(0), StaticBuffers()
    addresses, logits = _steps(model, sources(4), buffers)
    _steps(model, sources(4, seed=5), buffers, steps=5)  # other sentences in between
    addresses_again, logits_again = _steps(model, sources(4), buffers)
    assert addresses_again == addresses
    assert torch.equal(logits_again, logits)
    assert torch.equal(logits, _steps(model, sources(4), StaticBuffers())[1])
    ensemble = Ensemble([seq2seq(0), seq2seq(1)])  # same shapes: each member still gets its own buffers
    members = _steps(ensemble, sources(4), StaticBuffers())[0]
    assert len(set(members[:4]) & set(members[4:8])) == 0


def test_kv_cache_setting() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object: no GPU needed to choose
    assert DecodingSettings().kv_cache == "auto"
    for value in ("auto", "dynamic"):  # the growing cache on the CPU
        assert not DecodingSettings(kv_cache=value).stepping(cpu).static
    assert DecodingSettings(kv_cache="static").stepping(cpu).static
    assert not DecodingSettings(kv_cache="dynamic").stepping(cuda).static
    with pytest.raises(ValueError, match=r"decode\.kv_cache must be one of"):
        DecodingSettings.from_values({"kv_cache": "cuda_graph"}, prefix="decode.")
    for value in ("graphed", "compiled"):
        with pytest.raises(ValueError, match=f"kv_cache={value} cannot block repeated n-grams"):
            DecodingSettings(kv_cache=value, no_repeat_ngram_size=3)


def test_auto_is_the_graphed_step_on_cuda_where_the_search_allows() -> None:
    cuda = torch.device("cuda")
    for value in ("auto", "graphed"):
        stepping = DecodingSettings(kv_cache=value).stepping(cuda)
        assert stepping.static and stepping.buckets is not None
        assert stepping.step is static_cache.graphed_step()  # one per process: its graphs serve every search
    # the growing cache where a search needs it: prefixes and constraints, n-gram blocking's history
    assert not DecodingSettings().stepping(cuda, requests=True).static
    assert not DecodingSettings(no_repeat_ngram_size=2).stepping(cuda).static
    with pytest.raises(ValueError, match=r"kv_cache=graphed records CUDA graphs and needs a CUDA device"):
        DecodingSettings(kv_cache="graphed").stepping(torch.device("cpu"))


def test_graphed_and_static_caches_refuse_prefixes_and_constraints() -> None:
    model, src = seq2seq(0), sources(2)
    requests = [TargetRequest(prefix=(5,)), TargetRequest()]
    for value in ("static", "graphed", "compiled"):  # checked before the device is (graphed: CUDA only)
        with pytest.raises(ValueError, match=f"decode.kv_cache={value} cannot decode with prefixes"):
            search(model, src, DecodingSettings(kv_cache=value), requests=requests)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["inductor", "cudagraphs", "graphed"])
@pytest.mark.parametrize("beam_size", [1, 4])
def test_cuda_graph_step_decodes_what_the_growing_cache_decodes(
    monkeypatch, backend: str, beam_size: int
) -> None:
    """The real thing, three searches (warm-up, recording, replays): inductor in mode "reduce-overhead"
    (the step recorded and replayed as a CUDA graph), torch.compile's "cudagraphs" backend (the eager
    kernels recorded, no code generation; bench_gpu.py's `ours cudagraphs step`), and `GraphedStep` (the
    eager step recorded with torch.cuda.CUDAGraph, no compiler; `ours graphed step`)."""
    if backend == "graphed":
        step = GraphedStep()
        monkeypatch.setattr(static_cache, "compile_step", lambda device: step)
    else:
        monkeypatch.setattr(static_cache, "compile_step", lambda device: compile_step(device, backend))
        assert compile_step(torch.device("cuda"), backend).cuda_graphs
    model, src = seq2seq(0).cuda(), sources(16).cuda()
    dynamic = decoded(model, src, "dynamic", beam_size=beam_size)
    for _ in range(3):
        graphs = decoded(model, src, "compiled", beam_size=beam_size)
        assert torch.equal(graphs[0], dynamic[0])
        torch.testing.assert_close(graphs[1], dynamic[1], rtol=1e-5, atol=1e-4)
    if backend == "graphed":
        assert step.recorded == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("beam_size", [1, 4])
def test_cuda_default_decoding_is_the_graphed_step(beam_size: int) -> None:
    """decode.kv_cache=auto on CUDA: the process's graphed step, one recording for three searches, the
    growing cache's tokens (fp32)."""
    model, src = seq2seq(0).cuda(), sources(16).cuda()
    dynamic = decoded(model, src, "dynamic", beam_size=beam_size)
    step = static_cache.graphed_step()
    before = step.recorded
    for _ in range(3):
        auto = decoded(model, src, "auto", beam_size=beam_size)
        assert torch.equal(auto[0], dynamic[0])
        torch.testing.assert_close(auto[1], dynamic[1], rtol=1e-5, atol=1e-4)
    assert step.recorded == before + 1
