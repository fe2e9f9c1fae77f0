"""The buckets of `decode.kv_cache=compiled` (`transformer.search.buckets`): the sizes chosen, padding rows
that change no sentence's tokens or scores, each bucket's buffers made once and at the same addresses in
every search (what a CUDA graph recorded once per bucket replays on), no extra host reads, and a
compilation that gives up logged once, the search going on eagerly. The padded path runs here with the
step eager (a stand-in for the compiled one) or compiled with the cheap aot_eager backend."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import transformer.search.compiled as compiled
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
from transformer.search.buckets import Bucket, BucketCache, bucket_size, pad_rows
from transformer.search.compiled import compile_step
from transformer.search.decoding import DecodingSettings
from transformer.search.ensemble import Ensemble
from transformer.search.static_cache import StaticBuffers
from transformer.search.step import next_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")

UNCOMPILED = ["greedy", "beam4_nbest", "sample"]  # SEARCHES that kv_cache=compiled accepts


class _RecordingBuffers(StaticBuffers):
    """StaticBuffers that note the address of every tensor handed out, one list per search."""

    def __init__(self) -> None:
        super().__init__()
        self.searches: list[list[int]] = []

    def start(self) -> None:
        super().start()
        self.searches.append([])

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        view = super().zeros(shape, dtype, device)
        self.searches[-1].append(view.data_ptr())
        return view


@pytest.fixture
def buckets(monkeypatch: pytest.MonkeyPatch) -> Iterator[BucketCache[_RecordingBuffers]]:
    """kv_cache=compiled over fresh recording bucket buffers, its step run eagerly (another function than
    `next_log_probs`, so the search takes the compiled steps' path: fixed-address padded inputs)."""
    cache: BucketCache[_RecordingBuffers] = BucketCache(_RecordingBuffers)
    monkeypatch.setattr(static_cache, "_bucket_buffers", lambda: cache)
    monkeypatch.setattr(static_cache, "compile_step", lambda device: lambda *args: next_log_probs(*args))
    yield cache


def test_bucket_sizes() -> None:
    assert [bucket_size(n, 2) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [2, 2, 2, 4, 4, 8, 64, 128]
    assert [bucket_size(n, 16) for n in (1, 14, 16, 17, 40)] == [16, 16, 16, 32, 64]
    assert Bucket.of(rows=3, source=14, capacity=48, beams=4) == Bucket(4, 16, 64, 4)
    assert Bucket.of(rows=1, source=40, capacity=16, beams=1) == Bucket(2, 64, 16, 1)


def test_bucket_cache_keeps_the_last_used_buckets() -> None:
    cache: BucketCache[list[int]] = BucketCache(list, limit=2)
    a, b, c = Bucket(2, 16, 16, 1), Bucket(4, 16, 16, 1), Bucket(2, 16, 16, 4)
    first = cache[a]
    assert cache[b] is not first and cache[a] is first and cache.made == 2  # reused, not made again
    cache[c]  # the third: b, the least recently used, is dropped
    assert a in cache and c in cache and b not in cache and len(cache) == 2
    cache[b]
    assert cache.made == 4
    with pytest.raises(ValueError, match="at least one bucket"):
        BucketCache(list, limit=0)


def test_pad_rows() -> None:
    rows = torch.tensor([[1, 2], [3, 4]])
    assert pad_rows(rows, 3).tolist() == [[1, 2], [3, 4], [0, 0]]
    out = torch.zeros(4, 2, dtype=torch.long)
    assert pad_rows(rows, 4, out) is out and out.tolist() == [[1, 2], [3, 4], [0, 0], [0, 0]]


@pytest.mark.parametrize("name", UNCOMPILED)
def test_padding_rows_change_no_result(name: str, buckets: BucketCache[_RecordingBuffers]) -> None:
    """5 sentences 14 tokens wide padded to an (8, 16) bucket: the tokens and scores of every sentence are
    the growing cache's (sampling included: the padding rows draw nothing)."""
    model, src = seq2seq(0), sources(5)
    settings = {**SEARCHES[name], "min_len": 2}
    assert_same(decoded(model, src, "dynamic", **settings), decoded(model, src, "compiled", **settings))
    (bucket,) = buckets._held
    assert (bucket.rows, bucket.source) == (16 if name == "sample" else 8, 16)  # sample: 5 x n_best 2 rows


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("overrides", [{"positional": "rope"}, {"norm_first": True}], ids=str)
def test_padding_rows_with_other_models(
    beam_size: int, overrides: dict[str, Any], buckets: BucketCache[_RecordingBuffers]
) -> None:
    model, src = seq2seq(1, **overrides), widen(sources(3, seed=1), 20)  # buckets (4, 32)
    assert_same(
        decoded(model, src, "dynamic", beam_size=beam_size),
        decoded(model, src, "compiled", beam_size=beam_size),
    )
    ensemble, src = Ensemble([seq2seq(0), seq2seq(1, d_model=16, layers=1)]), sources(6, seed=2)
    assert_same(
        decoded(ensemble, src, "dynamic", beam_size=beam_size),
        decoded(ensemble, src, "compiled", beam_size=beam_size),
    )


def test_each_bucket_is_made_once_at_fixed_addresses(buckets: BucketCache[_RecordingBuffers]) -> None:
    """Searches alternating between two buckets (the sentences in another order each time): each
    bucket's buffers are made once, and every search of a bucket gets the same tensors at the same
    addresses in the same order, so a CUDA graph recorded on its first search replays on every later one."""
    model, order = seq2seq(0), torch.Generator().manual_seed(0)
    batches = [sources(5), widen(sources(12, seed=1), 30)]
    for _ in range(3):
        for src in batches:
            decoded(model, src[torch.randperm(src.shape[0], generator=order)], "compiled", beam_size=4)
    assert buckets.made == len(buckets) == 2
    for held in buckets._held.values():
        assert len(held.searches) == 3 and held.searches[0] == held.searches[1] == held.searches[2]


@pytest.mark.parametrize("name", UNCOMPILED)
def test_padded_steps_read_back_one_value_per_step(
    name: str, buckets: BucketCache[_RecordingBuffers]
) -> None:
    model = seq2seq(0)
    model.pack_tokens = False  # the GPU's encoder path, as in test_decoding_syncs
    per_step = syncs_per_step(
        model, sources(13), DecodingSettings(max_len_b=20, kv_cache="compiled", **SEARCHES[name])
    )
    assert len(per_step) > 6 and set(per_step[1:-1]) == {1}, per_step
    assert per_step[0] == 1 and per_step[-1] <= 2, per_step


@pytest.fixture
def fresh() -> Iterator[None]:
    fresh_compilation()
    yield
    fresh_compilation()


@pytest.mark.usefixtures("fresh")
def test_a_recompile_limit_hit_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With room for one compilation, beam search after greedy search hits Dynamo's limit: one warning
    naming it and the setting, and the searches go on eagerly with the same results."""
    monkeypatch.setattr(compiled, "RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(static_cache, "compile_step", lambda device: compile_step(device, "eager"))
    model, src = seq2seq(2, d_model=16, layers=1), sources(4)
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        for beam_size in (1, 4, 4, 1):
            assert_same(
                decoded(model, src, "dynamic", beam_size=beam_size),
                decoded(model, src, "compiled", beam_size=beam_size),
            )
    warnings = [r.getMessage() for r in caplog.records if r.name == compiled.__name__]
    assert len(warnings) == 1, warnings
    assert "decode.kv_cache=compiled" in warnings[0] and "FailOnRecompileLimitHit" in warnings[0]


@pytest.mark.usefixtures("fresh")
def test_a_compile_error_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(static_cache, "compile_step", lambda device: compile_step(device, broken_backend))
    model, src = seq2seq(2, d_model=16, layers=1), sources(4)
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        for _ in range(2):
            assert_same(decoded(model, src, "dynamic"), decoded(model, src, "compiled"))
    warnings = [r.getMessage() for r in caplog.records if r.name == compiled.__name__]
    assert len(warnings) == 1 and "BackendCompilerFailed" in warnings[0], warnings
    assert "decode.kv_cache=compiled" in warnings[0] and "eagerly" in warnings[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("fresh")
def test_cuda_graph_steps_over_buckets_compile_twice() -> None:
    """The real thing (inductor, CUDA graphs) in bench_gpu's order, beam 4 and greedy over two batch
    sizes, twice: at most 2 compilations, the growing cache's tokens, and no warning of a fallback."""
    counters.clear()
    model = seq2seq(0).cuda()
    for _ in range(2):
        for batch in (6, 20):
            src = sources(batch, seed=batch).cuda()
            for beam_size in (4, 1):
                dynamic = decoded(model, src, "dynamic", beam_size=beam_size)
                got = decoded(model, src, "compiled", beam_size=beam_size)
                assert torch.equal(got[0], dynamic[0])
                torch.testing.assert_close(got[1], dynamic[1], rtol=1e-5, atol=1e-4)
    assert counters["stats"]["unique_graphs"] <= 2
    assert compile_step(torch.device("cuda")).failure is None


def test_which_compiled_steps_record_cuda_graphs(monkeypatch) -> None:
    """Inductor in mode "reduce-overhead" and the "cudagraphs" backend record CUDA graphs on CUDA (each
    step then marks its start, so the last step's outputs may be reused), nothing else does; compiling
    is lazy, so this needs no GPU. One step per device kind and backend."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    compiled._compile_step.cache_clear()
    try:
        cuda, cpu = torch.device("cuda"), torch.device("cpu")
        assert compile_step(cuda).cuda_graphs and calls[-1]["mode"] == "reduce-overhead"
        assert compile_step(cuda, "cudagraphs").cuda_graphs and calls[-1]["mode"] is None
        assert not compile_step(cpu).cuda_graphs and calls[-1]["mode"] is None
        assert not compile_step(cuda, "aot_eager").cuda_graphs
        assert compile_step(cuda, "cudagraphs") is compile_step(cuda, "cudagraphs") and len(calls) == 4
    finally:
        compiled._compile_step.cache_clear()
