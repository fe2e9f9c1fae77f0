"""data/wordpiece.py on small vocabularies written here: vocab.txt's case and accent settings as
BertTokenizerFast reads them, decoding up to the first [SEP], and what it refuses (a vocabulary larger than
the model's, a tokenizer.json of another model)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import tokenizers

from data.wordpiece import WordPieceTokenizer

transformers = pytest.importorskip("transformers")

VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "Hello", "world", "World", "cafe", "café",
    "Café", "Cafe", "naive", "naïve", "##s", "##e", "##é", "c", "a", "f", "e", "é", ".",
]  # fmt: skip
TEXTS = ["Hello world .", "hello World", "Café naïve", "cafe cafés Cafe", "CAFÉ hellos", "unknown"]


def _directory(tmp_path: Path, settings: dict) -> Path:
    directory = tmp_path / "bert"
    directory.mkdir(parents=True)
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return directory


@pytest.mark.parametrize(
    "settings",
    [
        {},  # BertTokenizer's defaults: lower-cased, accents stripped
        {"do_lower_case": False},  # cased: accents kept
        {"do_lower_case": True, "strip_accents": False},
        {"do_lower_case": False, "strip_accents": True},
    ],
    ids=["defaults", "cased", "lower-keep-accents", "cased-strip-accents"],
)
def test_vocab_txt_settings_give_bert_tokenizer_fasts_ids(tmp_path: Path, settings: dict) -> None:
    directory = _directory(tmp_path, settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.BertTokenizerFast(str(directory / "vocab.txt"), **settings)
    ours = WordPieceTokenizer.from_directory(directory)
    assert ours.encode_batch(TEXTS) == reference(TEXTS).input_ids
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.unk_id) == (2, 3, 0, 1)


def test_the_settings_change_the_ids(tmp_path: Path) -> None:
    """The cases above differ from each other (a tokenizer that ignored the settings would fail them)."""
    ids = set()
    for i, settings in enumerate(({}, {"do_lower_case": False}, {"strip_accents": False})):
        ours = WordPieceTokenizer.from_directory(_directory(tmp_path / str(i), settings))
        ids.add(str(ours.encode_batch(TEXTS)))
    assert len(ids) == 3


def test_decoding_stops_at_the_first_sep(tmp_path: Path) -> None:
    ours = WordPieceTokenizer.from_directory(_directory(tmp_path, {}))
    hello, world, sep = (VOCAB.index(t) for t in ("hello", "world", "[SEP]"))
    assert ours.decode([2, hello, world, sep, hello, hello]) == "hello world"
    assert ours.decode([2, hello, world]) == "hello world"  # no [SEP]: every token
    assert ours.decode_batch([[2, world, sep, world], [2, sep]]) == ["world", ""]


def test_a_vocabulary_larger_than_the_model_and_other_tokenizers_are_refused(tmp_path: Path) -> None:
    directory = _directory(tmp_path, {})
    larger = WordPieceTokenizer.from_directory(directory, vocab_size=len(VOCAB) + 6)  # a padded table
    assert larger.vocab_size == len(VOCAB) + 6
    with pytest.raises(ValueError, match=f"has {len(VOCAB)} tokens, more than the model's 10"):
        WordPieceTokenizer.from_directory(directory, vocab_size=10)
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=[]))
    bpe.save(str(directory / "tokenizer.json"))
    with pytest.raises(ValueError, match="its tokenizer is not WordPiece"):
        WordPieceTokenizer.from_directory(directory)
    (directory / "tokenizer.json").unlink()
    (directory / "vocab.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"neither tokenizer\.json nor vocab\.txt"):
        WordPieceTokenizer.from_directory(directory)
