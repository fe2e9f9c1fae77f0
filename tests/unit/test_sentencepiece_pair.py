"""`data.sentencepiece_pair.SentencePiecePair` against transformers' `MarianTokenizer` on the same files.

A Marian tokenizer directory is made here as OPUS-MT's are: a German and an English SentencePiece
(unigram) model trained on Multi30k's training text, one vocabulary of the pieces of both with </s> = 0,
<unk> = 1 and <pad> last (a language code token too). On 200 validation sentences the source and target
ids must equal MarianTokenizer's, and so must the text decoded from ids.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

sentencepiece = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

from data.sentencepiece_pair import SentencePiecePair  # noqa: E402
from tests.conftest import _data_dir  # noqa: E402


def _lines(directory: Path, name: str, n: int) -> list[str]:
    with gzip.open(directory / name, "rt", encoding="utf-8") as handle:
        return [next(handle).rstrip("\n") for _ in range(n)]


def _train(path: Path, lines: list[str], vocab_size: int) -> None:
    path.with_suffix(".txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(path.with_suffix(".txt")), model_prefix=str(path.with_suffix("")), vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2,
    )  # fmt: skip
    path.with_suffix(".model").rename(path)


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory) -> Path:
    data = _data_dir("MULTI30K_DIR")
    directory = tmp_path_factory.mktemp("opus-mt-de-en")
    _train(directory / "source.spm", _lines(data, "train.de.gz", 3000), 400)
    _train(directory / "target.spm", _lines(data, "train.en.gz", 3000), 300)
    pieces: dict[str, None] = {}
    for name in ("source.spm", "target.spm"):
        processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / name))
        pieces.update((processor.id_to_piece(i), None) for i in range(1, processor.get_piece_size()))
    # one shared vocabulary as OPUS-MT's: </s>, <unk>, a language code, the pieces, <pad> last; a few
    # German pieces left out, so that <unk> comes from the vocabulary as well as from SentencePiece
    words = [piece for piece in pieces if piece not in ("</s>", "<unk>", "<pad>")][:-5]
    vocab = {"</s>": 0, "<unk>": 1, ">>deu<<": 2, **{p: i + 3 for i, p in enumerate(words)}}
    vocab["<pad>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "MarianTokenizer", "separate_vocabs": False}), encoding="utf-8"
    )
    return directory


@pytest.fixture(scope="module")
def sentences() -> dict[str, list[str]]:
    data = _data_dir("MULTI30K_DIR")
    return {side: _lines(data, f"val.{side}.gz", 200) for side in ("de", "en")}


@pytest.fixture(scope="module")
def theirs(marian_dir: Path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses" (a normalizer not used here)
        return transformers.MarianTokenizer.from_pretrained(marian_dir)


def test_source_and_target_ids_equal_marian_tokenizer_s(marian_dir, sentences, theirs) -> None:
    ours = SentencePiecePair.from_directory(marian_dir)
    source = [*sentences["de"], ">>deu<< Ein Hund läuft.", "Zeichen wie ©, ½ und ∑ kennt er nicht."]
    assert [ours.encode_source(text) for text in source] == theirs(source)["input_ids"]
    assert [ours.encode(text) for text in sentences["en"]] == theirs(text_target=sentences["en"])["input_ids"]
    assert any(ours.unk_id in ours.encode_source(text) for text in source)  # unknown pieces were exercised
    assert (ours.pad_id, ours.bos_id, ours.eos_id, ours.vocab_size) == (
        theirs.pad_token_id, theirs.pad_token_id, theirs.eos_token_id, len(theirs)
    )  # fmt: skip


def test_decoded_text_equals_marian_tokenizer_s(marian_dir, sentences, theirs) -> None:
    ours = SentencePiecePair.from_directory(marian_dir)
    for text in sentences["en"]:
        ids = ours.encode(text) + [ours.pad_id] * 2  # a hypothesis as a search returns it: EOS, then pads
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_the_state_round_trips_and_missing_files_are_named(marian_dir, tmp_path: Path) -> None:
    ours = SentencePiecePair.from_directory(marian_dir)
    again = SentencePiecePair.from_state(json.loads(json.dumps(ours.to_state())))  # plain JSON data
    assert again.encode_source("Ein Mann fährt Rad.") == ours.encode_source("Ein Mann fährt Rad.")
    (tmp_path / "source.spm").write_bytes((marian_dir / "source.spm").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"target\.spm: a Marian tokenizer needs source\.spm"):
        SentencePiecePair.from_directory(tmp_path)
