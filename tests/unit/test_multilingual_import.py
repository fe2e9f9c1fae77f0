"""Issue 65 item 4: a multilingual OPUS-MT model (tests/helpers/multilingual_opus_mt.py: a tiny one-to-many
Marian model made locally, its vocabulary holding `>>deu<<`, `>>fra<<`, `>>spa<<`). Its labels stay one
token each and our source ids equal MarianTokenizer's; the import lists them in the checkpoint
(`language_labels`) and `target_lang=fra` puts `>>fra<<` in front of the source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.labels import LanguageLabels
from data.sentencepiece_pair import SentencePiecePair
from tests.helpers.multilingual_opus_mt import LABELS, SOURCES, multilingual_opus_mt_directory
from tests.helpers.opus_mt import quiet_marian_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return multilingual_opus_mt_directory(tmp_path_factory.mktemp("opus_mt_mul") / "model")


def test_the_vocabularys_labels_are_the_models_languages(directory: Path, tmp_path: Path) -> None:
    pair = SentencePiecePair.from_directory(directory)
    assert pair.language_labels() == LanguageLabels(LABELS)
    assert sorted(quiet_marian_tokenizer(directory).supported_language_codes) == sorted(LABELS.values())
    vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    one = {piece: i for piece, i in vocab.items() if piece not in (">>fra<<", ">>spa<<")}
    single = SentencePiecePair(pair.source_model, pair.target_model, one)
    assert single.language_labels() is None  # one target language: no label to choose
    none = {piece: i for piece, i in one.items() if piece != ">>deu<<"}
    assert SentencePiecePair(pair.source_model, pair.target_model, none).language_labels() is None


@pytest.mark.parametrize("text", ["Hello world", *SOURCES])
@pytest.mark.parametrize("label", [*LABELS.values(), ">>xyz<<"])
def test_our_ids_equal_marian_tokenizers(directory: Path, text: str, label: str) -> None:
    pair = SentencePiecePair.from_directory(directory)
    marian = quiet_marian_tokenizer(directory)
    labelled = f"{label} {text}"
    assert pair.encode_source(labelled) == marian(labelled).input_ids
    if label in LABELS.values():  # one token, then the text's own pieces
        assert pair.encode_source(labelled) == [pair.vocab[label], *pair.encode_source(text)]
