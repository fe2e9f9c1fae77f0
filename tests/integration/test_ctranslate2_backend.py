"""The CTranslate2 backend of the inference API (`transformer.inference.ctranslate2`, issue 64 item 5): the
checkpoint converted by the existing export and decoded by CTranslate2 translates as the torch backend
(`Translator`) does, token for token and score for score, where both can; int8 runs; what CTranslate2
cannot do as ours is one `InferenceError` naming the option.

Two models: the session's tiny quickstart run (`tests.helpers.trained.translation_run`) on its own test
split, and an OPUS-MT-shaped model imported by `aiayn-import` (trained here to copy German, so that it
writes real sentences of many lengths, `tests.helpers.opus_mt.train_to_copy`) on Multi30k test sentences.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from data.synthetic import make_synthetic_splits
from tests.helpers import trained
from tests.helpers.datasets import data_dir
from tests.helpers.opus_mt import train_to_copy
from tests.helpers.pretrained import multi30k_lines, opus_mt_directory
from transformer.checkpoint import load_checkpoint
from transformer.inference import InferenceError, Segment, Translation, Translator, load
from transformer.inference.ctranslate2 import CTranslate2Translator
from transformer.interop.import_hf import import_hf

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # the session's training run
translation_run = trained.translation_run
# the tiny run mostly ends at once: at least 3 tokens, at most 6 (as tests/integration/test_inference.py)
FORCED = {"min_len": 3, "max_len_b": 6}
N_MULTI30K = 100


def _lists(translations: list[Translation]) -> list[list[str]]:
    return [[hypothesis.text for hypothesis in translation.hypotheses] for translation in translations]


def _assert_same(ours: list[Translation], theirs: list[Translation]) -> None:
    """The same texts in the same order, scores within float32 rounding of two implementations."""
    assert _lists(theirs) == _lists(ours)
    for mine, other in zip(ours, theirs):
        for a, b in zip(mine.hypotheses, other.hypotheses):
            assert b.score == pytest.approx(a.score, abs=1e-4)
        assert mine.unsatisfiable == other.unsatisfiable


@pytest.fixture(scope="module")
def quickstart(translation_run: Path) -> tuple[Path, list[str]]:
    """The run's last checkpoint and its test split's sources (regenerated from the run's data settings)."""
    checkpoint = translation_run / "checkpoints" / "epoch_000.ckpt"  # the best by val/loss: varied outputs
    data = load_checkpoint(checkpoint)["config"]["data"]
    sources, _ = make_synthetic_splits(data["seed"], data["synthetic_sizes"])["test"]
    return checkpoint, list(sources)


@pytest.fixture(scope="module")
def opus_mt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("ct2-opus-mt")
    directory = opus_mt_directory(root / "opus-mt-de-en", data_dir("MULTI30K_DIR"))
    train_to_copy(directory)
    sentences = multi30k_lines(data_dir("MULTI30K_DIR"), "test_2016_flickr.de.gz", N_MULTI30K)
    return import_hf(directory, root / "imported"), sentences


def test_greedy_equals_the_torch_backend_on_the_test_split(quickstart, tmp_path: Path) -> None:
    """Greedy search with min_len at the checkpoint's length limit: the same translations and scores; beam 4
    at length penalty 0 too. The converted directory is kept in `cache_dir` under the checkpoint's digest and
    reused by the next load."""
    checkpoint, sources = quickstart
    torch_backend = Translator.from_checkpoint(checkpoint)
    ct2 = CTranslate2Translator.from_checkpoint(checkpoint, cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [ct2.directory.name] and len(ct2.directory.name) == 16
    assert (ct2.task, ct2.paths, ct2.languages) == ("translation", [checkpoint], torch_backend.languages)
    assert ct2.num_parameters == torch_backend.num_parameters and ct2.device == torch.device("cpu")
    assert dict(ct2.defaults) == dict(torch_backend.defaults)
    ours = torch_backend.translate(sources, beam_size=1, **FORCED)
    theirs = ct2.translate(sources, beam_size=1, **FORCED)
    _assert_same(ours, theirs)
    assert len({t.text for t in theirs}) >= 3 and all(t.text for t in theirs)
    beam = {"beam_size": 4, "length_penalty": 0.0, "max_len_b": 6}  # min_len with beams: refused (below)
    _assert_same(torch_backend.translate(sources, **beam), ct2.translate(sources, **beam))
    modified = (ct2.directory / "model.bin").stat().st_mtime_ns
    again = CTranslate2Translator.from_checkpoint(checkpoint, cache_dir=tmp_path)
    assert again.directory == ct2.directory and (again.directory / "model.bin").stat().st_mtime_ns == modified


def test_an_imported_opus_mt_model_translates_as_the_torch_backend(opus_mt) -> None:
    """Greedy at the import's length limit, at tight limits where most sentences are cut (CTranslate2 stops
    one token before it and ours adds the forced EOS: the same tokens and, scored by CTranslate2 with that
    EOS, the same scores; one limit for all, and limits that differ within a batch), with n-gram blocking
    and with target prefixes; beam 4 at length penalty 0; and the temporary conversion is removed with its
    translator. (Beam search at a limit that cuts hypotheses is not compared: CTranslate2 ranks them
    without the forced EOS, docs/serving.md.)"""
    checkpoint, sentences = opus_mt
    torch_backend = Translator.from_checkpoint(checkpoint)
    ct2 = CTranslate2Translator.from_checkpoint(checkpoint)
    for options in (
        {"beam_size": 1},
        {"beam_size": 1, "max_len_a": 0, "max_len_b": 12},
        {"beam_size": 1, "max_len_a": 0.5, "max_len_b": 2},  # limits that differ within a batch, most cut
        {"beam_size": 1, "no_repeat_ngram_size": 2},
        {"beam_size": 4, "length_penalty": 0.0},
    ):
        ours = torch_backend.translate(sentences, **options)
        _assert_same(ours, ct2.translate(sentences, **options))
        assert len({t.text for t in ours}) >= N_MULTI30K // 2, options  # real, varied sentences
    prefixed = [Segment(text, prefix=prefix) for text, prefix in zip(sentences[:20], ["Ein", "Hund"] * 10)]
    for options in ({"beam_size": 1}, {"beam_size": 4, "length_penalty": 0.0}):
        theirs = ct2.translate(prefixed, **options)
        _assert_same(torch_backend.translate(prefixed, **options), theirs)
        assert all(t.text.startswith(("Ein", "Hund")) for t in theirs)
    directory = ct2.directory
    assert (directory / "model.bin").is_file()
    del ct2
    gc.collect()
    assert not directory.exists()


def test_int8_runs_and_gives_sentences(opus_mt) -> None:
    checkpoint, sentences = opus_mt
    int8 = CTranslate2Translator.from_checkpoint(checkpoint, compute_type="int8")
    ours = [t.text for t in Translator.from_checkpoint(checkpoint).translate(sentences, beam_size=1)]
    theirs = [t.text for t in int8.translate(sentences, beam_size=1)]
    assert all(text.strip() for text in theirs) and len(set(theirs)) >= N_MULTI30K // 2
    assert sum(a == b for a, b in zip(ours, theirs)) >= N_MULTI30K // 2  # quantized: most, not all


def test_sampling_gives_n_samples_that_repeat_with_the_seed(opus_mt) -> None:
    checkpoint, sentences = opus_mt
    options = {"search": "sample", "n_best": 3, "top_k": 10}
    draws = [
        _lists(CTranslate2Translator.from_checkpoint(checkpoint, seed=7).translate(sentences[:5], **options))
        for _ in range(2)
    ]
    assert draws[0] == draws[1] and all(len(row) == 3 for row in draws[0])
    assert len({text for row in draws[0] for text in row}) >= 10  # draws, not one repeated hypothesis


def test_what_ctranslate2_cannot_do_as_ours_is_refused_by_name(opus_mt) -> None:
    checkpoint, sentences = opus_mt
    ct2 = CTranslate2Translator.from_checkpoint(checkpoint)
    refused = {
        "length_penalty=1.0 with beam_size=4": {},  # the import's own defaults: len ** alpha, beam 4
        "n_best=2 with beam_size=4": {"length_penalty": 0.0, "n_best": 2},
        "min_len=2 with beam_size=4": {"length_penalty": 0.0, "min_len": 2},
        "no_repeat_ngram_size=2 with beam_size=4": {"length_penalty": 0.0, "no_repeat_ngram_size": 2},
        "temperature=0.5": {"beam_size": 1, "temperature": 0.5},
        "alignments": {"beam_size": 1, "alignments": True},
        "beam_size must be an integer >= 1, got -1": {"beam_size": -1},
    }
    for named, options in refused.items():
        with pytest.raises(InferenceError, match=named.replace("(", r"\(")):
            ct2.translate(sentences[:1], **options)
    with pytest.raises(InferenceError, match="segment 0: constraints: the CTranslate2 backend cannot"):
        ct2.translate([Segment(sentences[0], constraints=("Hund",))], beam_size=1)
    with pytest.raises(InferenceError, match="generator: CTranslate2 samples with its own"):
        ct2.translate(sentences[:1], search="sample", generator=torch.Generator().manual_seed(0))
    with pytest.raises(InferenceError, match="compute_type='int3' is not one CTranslate2 supports on cpu"):
        CTranslate2Translator.from_checkpoint(checkpoint, compute_type="int3")
    with pytest.raises(InferenceError, match="decodes one checkpoint, got 2"):
        CTranslate2Translator.from_checkpoint([checkpoint, checkpoint])
    assert ct2.translate([], beam_size=1) == []


def test_load_chooses_the_backend(opus_mt) -> None:
    checkpoint, sentences = opus_mt
    int8 = load(checkpoint, backend="ctranslate2", compute_type="int8")
    assert isinstance(int8, CTranslate2Translator) and int8.compute_type == "int8"
    assert int8.translate(sentences[:2], beam_size=1)[0].text
    assert isinstance(load(checkpoint), Translator)
    with pytest.raises(InferenceError, match="backend='onnx' is not a backend; expected torch or"):
        load(checkpoint, backend="onnx")
    with pytest.raises(InferenceError, match="compute_type='int8' is CTranslate2's"):
        load(checkpoint, compute_type="int8")
