"""Decoding keeps its bookkeeping on the device: every search (greedy, beam, sampling, one model or an
ensemble) reads back at most 1 value per step plus a constant before and after the loop, whatever the
batch and beam size (counted on the CPU through a TorchFunctionMode that sees every
call that would make a GPU wait), and a CUDA run under torch's sync debug mode agrees."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.syncs import VOCAB, SyncCounter, syncs_per_step
from tests.helpers.tiny import tiny_seq2seq, tiny_sources
from transformer.model import Seq2SeqTransformer
from transformer.search.constraints import TargetRequest
from transformer.search.decoding import DecodingSettings, search
from transformer.search.ensemble import Ensemble
from transformer.search.static_cache import Stepping

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int, d_model: int = 32, layers: int = 2) -> Seq2SeqTransformer:
    model = tiny_seq2seq(seed, vocab=VOCAB, d_model=d_model, layers=layers)
    model.pack_tokens = False  # the GPU's encoder path (the CPU's packed one reads back once per search)
    return model


def _sources(batch: int, seed: int = 0) -> torch.Tensor:
    return tiny_sources(batch, vocab=VOCAB, seed=seed)


SEARCHES = {
    "greedy": {"beam_size": 1},
    "beam4": {"beam_size": 4, "n_best": 4},
    "sample": {"search": "sample", "top_k": 5, "top_p": 0.9, "n_best": 2},
    "constrained_beam": {"beam_size": 4, "min_len": 3, "no_repeat_ngram_size": 2},
}


@pytest.mark.parametrize("batch", [8, 64])
@pytest.mark.parametrize("name", list(SEARCHES))
def test_at_most_one_host_read_per_decoding_step(name: str, batch: int) -> None:
    per_step = syncs_per_step(_model(0), _sources(batch), DecodingSettings(max_len_b=20, **SEARCHES[name]))
    before, steps, after = per_step[0], per_step[1:-1], per_step[-1]
    assert len(steps) >= 5, "the search should run several steps"
    # the loops read exactly one number per step (how many rows still decode)
    assert set(steps) == {1}, f"host reads per step: {steps}"
    assert before == 1 and after <= 2, (before, after)  # the longest length; at the end the n-best length


@pytest.mark.parametrize("name", list(SEARCHES))
def test_an_ensemble_reads_back_no_more(name: str) -> None:
    ensemble = Ensemble([_model(0), _model(1, d_model=16, layers=1)])
    per_step = syncs_per_step(ensemble, _sources(16), DecodingSettings(max_len_b=20, **SEARCHES[name]))
    assert len(per_step) >= 7, "the search should run several steps"
    assert set(per_step[1:-1]) == {1} and per_step[0] == 1 and per_step[-1] <= 2, per_step


def _requests(batch: int, include: bool) -> list[TargetRequest]:
    """Prefixes, avoided phrases and (`include`) required phrases of every shape: none, one token, several."""
    phrases = [((5,), (6, 7, 8)), ((9, 10),), ()]
    return [
        TargetRequest(
            prefix=(4, 11)[: b % 3],
            include=phrases[b % 3] if include else (),
            avoid=((12,), (13, 14)) if b % 2 else (),
        )
        for b in range(batch)
    ]


@pytest.mark.parametrize("ensemble", [False, True], ids=["one_model", "ensemble"])
@pytest.mark.parametrize("name", ["greedy", "beam4", "sample"])
def test_constraints_keep_one_host_read_per_step(name: str, ensemble: bool) -> None:
    model = Ensemble([_model(0), _model(1, d_model=16, layers=1)]) if ensemble else _model(0)
    requests = _requests(16, include=name != "sample")
    per_step = syncs_per_step(model, _sources(16), DecodingSettings(max_len_b=20, **SEARCHES[name]), requests)
    assert len(per_step) >= 7, "the search should run several steps"
    assert set(per_step[1:-1]) == {1} and per_step[0] == 1 and per_step[-1] <= 2, per_step


def test_the_counter_sees_the_reads_it_must_see() -> None:
    """The counter is not blind: the syncing idioms the old loop used are counted."""
    counter = SyncCounter()
    ended = torch.tensor([[True, False], [False, True]])
    with counter:
        ended.nonzero().tolist()
        _ = ended[0, 0].item(), bool(ended.any()), int(ended.sum())
        _ = torch.arange(2)[ended[0]]
        torch.arange(2).repeat_interleave(torch.tensor([1, 2]))
    assert counter.per_step == [7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_cache", ["dynamic", "auto"])  # auto: the graphed step on CUDA
@pytest.mark.parametrize("name", list(SEARCHES))
def test_cuda_decoding_syncs_at_most_once_per_step(
    monkeypatch: pytest.MonkeyPatch, name: str, kv_cache: str
) -> None:
    """On a GPU, torch's own sync detector: at most 1 synchronizing call per decoder step + a constant,
    in a search after a first one (which records the graphed step's CUDA graphs: recording synchronizes).
    Steps are counted by the search loop (`Stepping.advance`): a replayed graph calls no model code."""
    model = _model(0).cuda()
    src = _sources(64).cuda()
    settings = DecodingSettings(max_len_b=20, kv_cache=kv_cache, **SEARCHES[name])
    search(model, src, settings)
    steps = []
    advance = Stepping.advance

    def counted(self: Stepping, cache: object) -> None:
        steps.append(1)
        advance(self, cache)

    monkeypatch.setattr(Stepping, "advance", counted)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            search(model, src, settings)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(steps) >= 7, "the search should run several steps"
    assert len(syncs) <= len(steps) + 3, f"{len(syncs)} syncs in {len(steps)} steps"
