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


# --- each setting's default when tokenizer_config.json leaves it out (BertTokenizerFast's: lower-cased,
# accents stripped when lower-casing, CJK characters split), one key missing at a time -----------------

CJK_VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "東", "京", "東京", "cafe", "café", "Café", "CAFÉ", "##s",
    "東京café", "[X]", "<cls>", "<sep>",
]  # fmt: skip
CJK_TEXTS = ["東京 café", "東京café CAFÉ", "Cafés 東京", "a [MASK] b [SEP] c", "<cls> [X] 東京"]


def _cjk_directory(tmp_path: Path, settings: dict) -> Path:
    directory = tmp_path / "cjk"
    directory.mkdir(parents=True)
    (directory / "vocab.txt").write_text("\n".join(CJK_VOCAB) + "\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return directory


def _reference(directory: Path, settings: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.BertTokenizerFast(str(directory / "vocab.txt"), **settings)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"do_lower_case": True},
        {"do_lower_case": False},
        {"strip_accents": True},
        {"strip_accents": False},
        {"strip_accents": None},
        {"tokenize_chinese_chars": True},
        {"tokenize_chinese_chars": False},
        {"do_lower_case": False, "tokenize_chinese_chars": False},
        {"do_lower_case": False, "strip_accents": False, "tokenize_chinese_chars": True},
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()) or "nothing",
)
def test_a_setting_left_out_takes_bert_tokenizer_fasts_default(tmp_path: Path, settings: dict) -> None:
    directory = _cjk_directory(tmp_path, settings)
    ours = WordPieceTokenizer.from_directory(directory)
    assert ours.encode_batch(CJK_TEXTS) == _reference(directory, settings)(CJK_TEXTS).input_ids


def test_the_cjk_and_case_defaults_are_the_ones_that_change_ids(tmp_path: Path) -> None:
    """Left out, tokenize_chinese_chars is on (東京 -> 東, 京) and do_lower_case on (CAFÉ -> cafe): the
    vocabulary holds the unsplit and the cased forms, so the other default gives other ids."""
    ours = WordPieceTokenizer.from_directory(_cjk_directory(tmp_path / "a", {}))
    east, capital, cafe = (CJK_VOCAB.index(t) for t in ("東", "京", "cafe"))
    assert ours.encode("東京 CAFÉ") == [2, east, capital, cafe, 3]
    unsplit = WordPieceTokenizer.from_directory(
        _cjk_directory(tmp_path / "b", {"tokenize_chinese_chars": False})
    )
    assert unsplit.encode("東京 CAFÉ") == [2, CJK_VOCAB.index("東京"), cafe, 3]
    cased = WordPieceTokenizer.from_directory(_cjk_directory(tmp_path / "c", {"do_lower_case": False}))
    assert cased.encode("東京 CAFÉ") == [2, east, capital, CJK_VOCAB.index("CAFÉ"), 3]
    keep_accents = WordPieceTokenizer.from_directory(_cjk_directory(tmp_path / "d", {"strip_accents": False}))
    assert keep_accents.encode("CAFÉ") == [2, CJK_VOCAB.index("café"), 3]


@pytest.mark.parametrize("as_dict", [False, True])
def test_special_tokens_named_by_the_config_are_its_own(tmp_path: Path, as_dict: bool) -> None:
    """cls_token / sep_token / unk_token / mask_token given (a string, or transformers' added-token dict with
    "content"): their ids, and a mask token kept whole in text, as BertTokenizerFast."""
    names = {"cls_token": "<cls>", "sep_token": "<sep>", "unk_token": "[X]", "mask_token": "[PAD]"}
    written = {k: {"content": v, "special": True} if as_dict else v for k, v in names.items()}
    directory = _cjk_directory(tmp_path, written)
    ours = WordPieceTokenizer.from_directory(directory)
    reference = _reference(directory, names)
    assert (ours.bos_id, ours.eos_id, ours.unk_id, ours.pad_id) == (15, 16, 14, 0) == (
        reference.cls_token_id, reference.sep_token_id, reference.unk_token_id, reference.pad_token_id,
    )  # fmt: skip
    assert ours.encode_batch(CJK_TEXTS) == reference(CJK_TEXTS).input_ids
    default = WordPieceTokenizer.from_directory(_cjk_directory(tmp_path / "default", {}))
    assert default.encode("a [MASK] b") == [2, 1, 4, 1, 3]  # [MASK] one token, "a" and "b" unknown
    assert default.encode("[X]") != [2, 14, 3]  # only a configured unk_token is special


def test_the_models_vocabulary_may_equal_the_tokenizers_not_be_one_smaller(tmp_path: Path) -> None:
    directory = _directory(tmp_path, {})
    assert WordPieceTokenizer.from_directory(directory, vocab_size=len(VOCAB)).vocab_size == len(VOCAB)
    with pytest.raises(ValueError, match=f"has {len(VOCAB)} tokens, more than the model's {len(VOCAB) - 1}"):
        WordPieceTokenizer.from_directory(directory, vocab_size=len(VOCAB) - 1)
    assert WordPieceTokenizer.from_directory(directory).vocab_size == len(VOCAB)  # default: its own size


def test_control_characters_are_cleaned_as_bert_tokenizer_fast_cleans_them(tmp_path: Path) -> None:
    """BertNormalizer's clean_text: control characters dropped, tabs and newlines as spaces."""
    directory = _cjk_directory(tmp_path, {})
    texts = ["café\x07 東京", "CAFÉ\tcafé\n東京", "caf\x00é\ufffd"]
    ours = WordPieceTokenizer.from_directory(directory)
    assert ours.encode_batch(texts) == _reference(directory, {})(texts).input_ids
    assert ours.encode("café\x07") == [2, CJK_VOCAB.index("cafe"), 3]


def test_a_tokenizer_json_saved_with_truncation_or_padding_encodes_whole_sentences(tmp_path: Path) -> None:
    """transformers encodes without truncation or padding unless asked; so does ours, whatever the file."""
    directory = _cjk_directory(tmp_path, {})
    pipeline = WordPieceTokenizer.from_directory(directory).tokenizer
    pipeline.enable_truncation(max_length=3)
    pipeline.enable_padding(length=12, pad_id=0, pad_token="[PAD]")
    pipeline.save(str(directory / "tokenizer.json"))
    ours = WordPieceTokenizer.from_directory(directory)
    assert ours.encode("東京 café CAFÉ") == [2, 5, 6, 8, 8, 3]
    assert WordPieceTokenizer.from_json(ours.to_json()).encode("東京 café CAFÉ") == [2, 5, 6, 8, 8, 3]


def test_an_empty_special_token_name_in_the_config_is_the_default(tmp_path: Path) -> None:
    ours = WordPieceTokenizer.from_directory(_cjk_directory(tmp_path, {"unk_token": "", "cls_token": None}))
    assert (ours.unk_id, ours.bos_id) == (1, 2)
