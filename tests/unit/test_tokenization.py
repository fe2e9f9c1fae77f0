"""BPE tokenizers: fixed special ids, BOS/EOS, exact round trips on real Multi30k text, save/load, caching,
BPE-dropout."""

import gzip
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import models

from data import tokenization
from data.bpe_cache import bpe_fingerprint, load_or_train_bpe
from data.tokenization import (
    BPEDropout,
    BPETokenizer,
    Tokenizer,
    train_bpe,
)

TINY = ["the cat sat on the mat .", "the dog sat on the log .", "a cat and a dog ."] * 20


def _lines(path: Path, n: int | None = None) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [line.strip() for line in islice(handle, n)]


@pytest.fixture
def multi30k_tokenizer(multi30k_dir: Path) -> tuple[BPETokenizer, Path]:
    directory = multi30k_dir
    texts = _lines(directory / "train.en.gz", 3000) + _lines(directory / "train.de.gz", 3000)
    return train_bpe(texts, 2000), directory


def test_special_ids_and_bos_eos() -> None:
    tok = train_bpe(TINY, 30)
    assert [tok.tokenizer.id_to_token(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    ids = tok.encode("the cat sat .")
    assert ids[0] == 1 and ids[-1] == 2 and 0 not in ids
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 30


def test_round_trip_real_multi30k(multi30k_tokenizer: tuple[BPETokenizer, Path]) -> None:
    """decode(encode(x)) == x on unseen validation lines, German umlauts and punctuation included."""
    tok, directory = multi30k_tokenizer
    seen_chars = set(
        "".join(_lines(directory / "train.en.gz", 3000) + _lines(directory / "train.de.gz", 3000))
    )
    lines = _lines(directory / "val.de.gz") + _lines(directory / "val.en.gz")
    # Characters never seen in training become <unk> (dropped on decode); NFKC maps e.g. NBSP to a space.
    normal = [line for line in lines if set(line) <= seen_chars and "\xa0" not in line]
    assert len(normal) > 0.97 * len(lines)
    assert [tok.decode(tok.encode(line)) for line in normal] == normal
    assert any(c in line for line in normal for c in "äöüß")
    hard = 'Ein Mädchen, das "Hüte" trägt, läuft über die Straße (schnell)!'
    assert tok.decode(tok.encode(hard)) == hard
    assert tok.decode_batch(tok.encode_batch(normal[:5])) == normal[:5]


def test_nfkc_normalization() -> None:
    tok = train_bpe(["finally a file", "office"] * 5, 40)
    assert tok.decode(tok.encode("ﬁle\u00a0oﬃce")) == "file office"  # ligatures and NBSP normalized


def test_decode_stops_at_eos_and_skips_specials() -> None:
    tok = train_bpe(TINY, 60)
    ids = tok.encode("the dog")
    assert tok.decode([*ids, 5, 6, 0, 0]) == "the dog"  # junk after EOS ignored
    assert tok.decode(ids[1:-1]) == "the dog"  # no BOS / EOS at all
    assert tok.decode(torch.tensor([1, *ids[1:-1], 2, 0, 0])) == "the dog"
    assert tok.decode_batch(torch.tensor([[*ids, 0], [1, 2] + [0] * len(ids[1:])])) == ["the dog", ""]


def test_word_continuations_are_the_pieces_inside_words() -> None:
    """What constrained decoding bans after a required phrase: pieces that would lengthen its last word."""
    tok = train_bpe(["the dogs ran, the dog sat.", "a dog's day", "dogma and cats"] * 5, 38, min_frequency=1)
    continuing = set(tok.word_continuations())
    words = [tok.tokens(word)[1:-1] for word in ("dogs", "dogma", "cats")]  # BOS and EOS dropped
    assert all(len(pieces) > 1 for pieces in words), words  # each word splits into pieces here
    for pieces in words:
        assert tok.tokenizer.token_to_id(pieces[0]) not in continuing  # a word's start ("▁dog")
        assert all(tok.tokenizer.token_to_id(piece) in continuing for piece in pieces[1:])
    for piece in (".", ",", "'", *tokenization.SPECIAL_TOKENS):
        assert tok.tokenizer.token_to_id(piece) not in continuing


def test_json_save_load_identical_ids(tmp_path: Path) -> None:
    tok = train_bpe(TINY, 60)
    restored = BPETokenizer.from_json(tok.to_json())
    path = tmp_path / "sub" / "tokenizer.json"
    tok.save(path)
    loaded = BPETokenizer.load(path)
    for text in [*TINY[:3], "unseen words: zebra!"]:
        assert restored.encode(text) == loaded.encode(text) == tok.encode(text)
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temp files left behind


def test_training_is_deterministic() -> None:
    assert train_bpe(TINY, 50).to_json() == train_bpe(TINY, 50).to_json()


def test_load_or_train_skips_training_when_fingerprint_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokenizer.json"
    first = load_or_train_bpe(path, TINY, 50)
    assert (tmp_path / "tokenizer.json.fingerprint").read_text().strip() == bpe_fingerprint(
        TINY, vocab_size=50, min_frequency=2
    )

    def no_training(*args: object, **kwargs: object) -> BPETokenizer:
        raise AssertionError("trained again although nothing changed")

    with monkeypatch.context() as patch:
        patch.setattr(tokenization, "train_bpe", no_training)
        assert load_or_train_bpe(path, TINY, 50).to_json() == first.to_json()
    # Changed data or settings retrain (the old file is replaced, never silently reused).
    assert load_or_train_bpe(path, [*TINY, "zebra zebra zebra"], 50).encode("zebra") != first.encode("zebra")
    assert load_or_train_bpe(path, TINY, 30).vocab_size == 30


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(TINY, 4)
    broken = train_bpe(TINY, 50).tokenizer
    broken.add_special_tokens(["<mask>"])
    swapped = (
        broken.to_str().replace('"<pad>"', '"<tmp>"').replace('"<s>"', '"<pad>"').replace('"<tmp>"', '"<s>"')
    )
    with pytest.raises(ValueError, match="'<pad>' has id 1, expected 0"):
        BPETokenizer.from_json(swapped)


def test_bpe_dropout_at_zero_is_the_tokenizer(multi30k_tokenizer: tuple[BPETokenizer, Path]) -> None:
    """p=0 reproduces `tokenizers`' own BPE exactly: real text, punctuation, umlauts, unknown characters."""
    tok, directory = multi30k_tokenizer
    texts = _lines(directory / "val.en.gz", 300) + _lines(directory / "val.de.gz", 300)
    texts += ["Ein Mann (ca. 30) sagt: „Hallo!“ — don't", "ｆｕｌｌ-width and 漢字 ☃ unknown", "", "  a  b  "]
    plain = BPEDropout(tok, 0.0)
    rng = np.random.default_rng(0)
    assert [plain.encode(text, rng) for text in texts] == [tok.encode(text) for text in texts]
    assert tok.unk_id in plain.encode("漢字 ☃", rng)


def test_bpe_dropout_splits_words_reproducibly(multi30k_tokenizer: tuple[BPETokenizer, Path]) -> None:
    tok, directory = multi30k_tokenizer
    texts = _lines(directory / "val.en.gz", 200)
    dropout = BPEDropout(tok, 0.1)

    def encode_all(seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return [dropout.encode(text, rng) for text in texts]

    first = encode_all(1)
    assert first == encode_all(1)  # the generator alone decides
    assert first != encode_all(2)
    plain = [tok.encode(text) for text in texts]
    assert [tok.decode(ids) for ids in first] == [tok.decode(ids) for ids in plain]  # other splits, same text
    changed = sum(ids != base for ids, base in zip(first, plain)) / len(texts)
    assert 0.3 < changed < 1.0
    assert sum(map(len, first)) > 1.05 * sum(map(len, plain))
    assert tok.unk_id not in {i for ids in first for i in ids}  # every piece is in the vocabulary
    # Near p=1 almost every merge is skipped: words fall apart into characters.
    chars = BPEDropout(tok, 0.999).encode("a dog runs", np.random.default_rng(0))
    assert [tok.tokenizer.id_to_token(i) for i in chars[1:-1]] == [
        "▁",
        "a",
        "▁",
        "d",
        "o",
        "g",
        "▁",
        "r",
        "u",
        "n",
        "s",
    ]


def test_bpe_dropout_refuses_bad_settings() -> None:
    tok = train_bpe(TINY, 40)
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"BPE-dropout probability must be in \[0, 1\)"):
            BPEDropout(tok, p)
    suffixed = train_bpe(TINY, 40)
    suffixed.tokenizer.model = models.BPE(vocab={"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}, merges=[],
                                          end_of_word_suffix="</w>")  # fmt: skip
    with pytest.raises(ValueError, match="plain BPE model"):
        BPEDropout(suffixed, 0.1)
