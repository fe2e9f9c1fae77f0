"""Synthetic training pairs without models: the datamodule's extra pair files (tags, real-pair copies), the
monolingual file's checks, and the chunked corpus translation (resume, DDP shares, a full disk) with a
deterministic stand-in for the teachers (tests/integration/test_distill.py runs real ones)."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from data.datamodules import TranslationDataModule
from transformer.cli.distill import corpus
from transformer.cli.distill.corpus import Shard, finished_entry, translate_corpus
from transformer.cli.distill.synthetic import read_monolingual
from transformer.cli.errors import ConfigError
from transformer.disk import disk_full_line

TEXTS = [f"sentence number {i}" for i in range(23)]


def _reverse(calls: list[int]) -> Callable[[int, Sequence[str]], list[str]]:
    """A stand-in translator: each sentence reversed; records which chunks it was asked for."""

    def translate(index: int, texts: Sequence[str]) -> list[str]:
        calls.append(index)
        return [text[::-1] for text in texts]

    return translate


def _lines(entry: Path) -> list[str]:
    return (entry / corpus.TRANSLATIONS).read_text().splitlines()


# --- the datamodule's extra pairs ------------------------------------------------------------------


def _pairs(tmp_path: Path, sources: list[str], targets: list[str]) -> dict[str, str]:
    src, tgt = tmp_path / "synthetic.src", tmp_path / "synthetic.tgt"
    src.write_text("".join(f"{line}\n" for line in sources))
    tgt.write_text("".join(f"{line}\n" for line in targets))
    return {"src": str(src), "tgt": str(tgt)}


def test_tagged_extra_pairs_join_the_real_ones_and_the_tag_is_one_token(tmp_path: Path) -> None:
    files = _pairs(tmp_path, ["ein kleiner Hund", "zwei Katzen"], ["a small dog", "two cats"])
    datamodule = TranslationDataModule(
        synthetic_sizes={"train": 40, "val": 5, "test": 5},
        vocab_size=200,
        extra_train=[{**files, "tag": "<bt>"}],
        train_copies=2,
        cache_dir=tmp_path / "cache",
        show_progress=False,
    )
    datamodule.prepare_data()
    datamodule.setup("fit")
    raw = datamodule.raw_split("train")
    assert len(raw) == 2 * 40 + 2  # the real pairs twice, then the synthetic ones
    assert raw["src"][-2:] == ["<bt> ein kleiner Hund", "<bt> zwei Katzen"]
    assert not any(src.startswith("<bt>") for src in raw["src"][:80])
    assert raw["src"][:40] == raw["src"][40:80]
    tokenizer = datamodule.src_tokenizer
    tag = tokenizer.tokenizer.token_to_id("<bt>")
    assert tag is not None and tag > 3  # a special token after <pad> <s> </s> <unk>
    rows = datamodule.tokenized("train")
    tagged = [ids[1] == tag for ids in rows["src_ids"]]
    assert tagged == [row >= 80 for row in rows["id"]]  # exactly the synthetic sources carry it
    assert all(tag not in ids for ids, row in zip(rows["src_ids"], rows["id"]) if row < 80)
    assert tokenizer.decode(tokenizer.encode("<bt> zwei Katzen")) == "zwei Katzen"


def test_extra_pairs_alone_and_their_settings_checked(tmp_path: Path) -> None:
    files = _pairs(tmp_path, ["a", "b"], ["x", "y"])
    datamodule = TranslationDataModule(
        synthetic_sizes={"train": 10, "val": 2, "test": 2},
        extra_train=[{**files, "tag": None}],
        train_copies=0,
    )
    assert datamodule.raw_split("train")["src"] == ["a", "b"]
    with pytest.raises(ValueError, match="train_copies=0 leaves no training pairs"):
        TranslationDataModule(train_copies=0)
    with pytest.raises(ValueError, match=r"extra_train\[0\].tag must be one word"):
        TranslationDataModule(extra_train=[{**files, "tag": "<b t>"}])
    with pytest.raises(ValueError, match=r"extra_train\[0\] must be"):
        TranslationDataModule(extra_train=[{"src": files["src"]}])


# --- the monolingual file ---------------------------------------------------------------------------


def test_monolingual_text_plain_or_gz_blank_lines_skipped(tmp_path: Path) -> None:
    plain = tmp_path / "mono.de"
    plain.write_text("ein Hund\n\n  zwei Katzen \n")
    packed = tmp_path / "mono.de.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as handle:
        handle.write("ein Hund\n\n  zwei Katzen \n")
    assert read_monolingual(plain) == read_monolingual(packed) == ["ein Hund", "zwei Katzen"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "does not exist"),
        (b"\n \n", "is empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\rIHDR\xff\xfe", "invalid UTF-8"),
        (b"text\x00\x00\x00 more\n", "NUL bytes: a binary file"),
    ],
)
def test_bad_monolingual_file_is_one_line_naming_key_and_file(
    tmp_path: Path, content: bytes | None, expected: str
) -> None:
    path = tmp_path / "mono.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=expected) as info:
        read_monolingual(path)
    message = str(info.value)
    assert message.startswith("backtranslate.monolingual: ") and str(path) in message
    assert "\n" not in message


# --- the chunked translation ------------------------------------------------------------------------


def test_interrupted_translation_resumes_at_the_first_missing_chunk(tmp_path: Path) -> None:
    whole = translate_corpus(
        TEXTS, _reverse([]), directory=tmp_path / "a", name="distill", key="k" * 64, chunk_sentences=5
    )
    calls: list[int] = []

    def interrupted(index: int, texts: Sequence[str]) -> list[str]:
        if index == 3:
            raise KeyboardInterrupt
        return _reverse(calls)(index, texts)

    directory = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        translate_corpus(
            TEXTS, interrupted, directory=directory, name="distill", key="k" * 64, chunk_sentences=5
        )
    assert finished_entry(directory, "distill", "k" * 64) is None  # no partial corpus in the cache
    assert calls == [0, 1, 2]
    calls.clear()
    resumed = translate_corpus(
        TEXTS, _reverse(calls), directory=directory, name="distill", key="k" * 64, chunk_sentences=5
    )
    assert calls == [3, 4]  # only the chunks that were missing
    assert _lines(resumed) == _lines(whole) == [text[::-1] for text in TEXTS]
    assert not list(directory.glob(".*partial"))  # the chunks are gone once the corpus is whole
    calls.clear()
    again = translate_corpus(
        TEXTS, _reverse(calls), directory=directory, name="distill", key="k" * 64, chunk_sentences=5
    )
    assert again == resumed and calls == []  # a second run translates nothing


def test_an_entry_of_another_key_or_a_damaged_one_is_translated_again(tmp_path: Path) -> None:
    """The entry's directory is named by the key's first 16 characters: an entry there with another full
    key (a different corpus) is not reused, and one without its entry.json (damaged) is replaced."""
    key, other = "k" * 64, "k" * 16 + "x" * 48
    first = translate_corpus(
        TEXTS, _reverse([]), directory=tmp_path, name="distill", key=other, chunk_sentences=5
    )
    calls: list[int] = []
    entry = translate_corpus(
        TEXTS, _reverse(calls), directory=tmp_path, name="distill", key=key, chunk_sentences=5
    )
    assert entry == first and calls == [0, 1, 2, 3, 4]  # the same directory, translated again for this key
    assert (
        finished_entry(tmp_path, "distill", key) == entry
        and finished_entry(tmp_path, "distill", other) is None
    )
    (entry / corpus.ENTRY).unlink()  # damaged: no longer a finished entry
    calls.clear()
    again = translate_corpus(
        TEXTS, _reverse(calls), directory=tmp_path, name="distill", key=key, chunk_sentences=5
    )
    assert calls == [0, 1, 2, 3, 4] and _lines(again) == [text[::-1] for text in TEXTS]


def test_a_translator_that_loses_lines_stops_the_corpus(tmp_path: Path) -> None:
    def lossy(index: int, texts: Sequence[str]) -> list[str]:
        return [text[::-1] for text in texts][: 4 if index == 2 else None]

    with pytest.raises(RuntimeError, match="distill: chunk 2 gave 4 lines for 5"):
        translate_corpus(TEXTS, lossy, directory=tmp_path, name="distill", key="k" * 64, chunk_sentences=5)
    assert finished_entry(tmp_path, "distill", "k" * 64) is None


def test_ranks_translate_their_own_chunks_and_rank_zero_writes_the_corpus(tmp_path: Path) -> None:
    barrier = threading.Barrier(2)
    calls: dict[int, list[int]] = {0: [], 1: []}
    results: dict[int, Path] = {}

    def rank(number: int) -> None:
        shard = Shard(number, 2, barrier.wait)
        results[number] = translate_corpus(
            TEXTS,
            _reverse(calls[number]),
            directory=tmp_path,
            name="bt",
            key="d" * 64,
            chunk_sentences=5,
            shard=shard,
        )

    threads = [threading.Thread(target=rank, args=(n,)) for n in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert calls == {0: [0, 2, 4], 1: [1, 3]}
    assert results[0] == results[1] and _lines(results[0]) == [text[::-1] for text in TEXTS]


def test_full_disk_while_translating_is_one_line_and_leaves_no_corpus(
    tmp_path: Path,
    full_disk: Callable[[Path, int], None],
) -> None:
    directory = tmp_path / "cache"
    directory.mkdir()
    full_disk(directory, 60)  # about two chunks of translations fit
    with pytest.raises(OSError) as info:
        translate_corpus(
            TEXTS, _reverse([]), directory=directory, name="distill", key="f" * 64, chunk_sentences=5
        )
    line = disk_full_line(info.value)
    assert line is not None and "no space left on device" in line and "\n" not in line
    assert "writing chunk" in line and "of the distill translations" in line
    assert finished_entry(directory, "distill", "f" * 64) is None
    assert not [p for p in directory.rglob("*") if p.name.endswith(".tmp")]
