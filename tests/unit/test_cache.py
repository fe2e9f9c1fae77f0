"""The prepared-data cache: a later run memory-maps instead of reading and tokenizing, a change to what
makes the ids misses it, truncated or foreign entries are rebuilt after one warning, no two builders
collide."""

import json
import logging
import multiprocessing
import os
import time
from pathlib import Path

import datasets
import pytest

from data import cache, prepare, sources, tokenization
from data.datamodules import ClassificationDataModule, TranslationDataModule
from tests.helpers.data_digest import write_classification_fixture, write_fixture

SETTINGS = {"vocab_size": 300, "max_tokens": 600, "max_len": 40, "show_progress": False, "test_split": "test"}


def _translation(data_dir: Path, cache_dir: Path, **kwargs: object) -> TranslationDataModule:
    return TranslationDataModule("multi30k", data_dir, cache_dir=cache_dir, **{**SETTINGS, **kwargs})


def _entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in (cache_dir / "tokenized").iterdir() if not p.name.startswith("."))


def _forbid_preparation(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("read, trained or tokenized although the cache had everything")

    for module, name in (
        (sources.translation, "load_parallel"),
        (sources, "load_classification_files"),
        (tokenization, "train_bpe"),
        (prepare, "tokenize_split"),
    ):
        monkeypatch.setattr(module, name, fail)


def test_later_run_only_memory_maps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    data = write_fixture(tmp_path / "text")
    first = _translation(data, tmp_path / "cache")
    first.prepare_data()
    first.setup(None)  # the preprocess step: every split
    assert len(_entries(tmp_path / "cache")) == 3
    with monkeypatch.context() as patch, caplog.at_level(logging.INFO):
        _forbid_preparation(patch)
        again = _translation(data, tmp_path / "cache")
        again.prepare_data()
        again.setup("fit")
        again.setup("test")
        train = again.tokenized("train")
        assert train[:] == first.tokenized("train")[:]
        (entry,) = (tmp_path / "cache" / "tokenized").glob("*-train-*")
        assert [f["filename"] for f in train.cache_files] == [str(p) for p in sorted(entry.glob("*.arrow"))]
        batches = [b["id"].tolist() for b in again.train_dataloader()]
    assert batches == [b["id"].tolist() for b in first.train_dataloader()]
    assert "Using cache entry" in caplog.text and "train: dropped 2 of 598 examples" in caplog.text


def test_classification_class_names_come_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_classification_fixture(tmp_path / "tsv")
    files = {"source": "files", "file_pattern": "{split}.tsv", "text_column": "sentence", "test_split": "dev"}
    settings = {**SETTINGS, **files, "cache_dir": tmp_path / "cache"}
    first = ClassificationDataModule(data_dir=data, **settings)
    first.setup(None)
    with monkeypatch.context() as patch:
        _forbid_preparation(patch)
        again = ClassificationDataModule(data_dir=data, **settings)
        again.setup("fit")
        assert again.class_names == first.class_names == ["0", "1"]
        assert again.tokenized("dev")[:] == first.tokenized("dev")[:]


def test_changed_files_or_settings_miss(tmp_path: Path) -> None:
    data = write_fixture(tmp_path / "text")
    cache_dir = tmp_path / "cache"
    _translation(data, cache_dir).setup("fit")
    before = _entries(cache_dir)
    _translation(data, cache_dir, max_len=30).setup("fit")  # other length filter: new train and val entries
    assert len(_entries(cache_dir)) == len(before) + 2
    _translation(data, cache_dir, vocab_size=280).setup("fit")  # another tokenizer: new ids
    assert len(_entries(cache_dir)) == len(before) + 4
    tokenizers_before = len(list((cache_dir / "tokenizers").glob("*/tokenizer.json")))
    val = data / "val.de.gz"
    os.utime(val, ns=(val.stat().st_atime_ns, val.stat().st_mtime_ns + 10**9))  # touched: new val entry
    _translation(data, cache_dir).setup("fit")
    assert len(_entries(cache_dir)) == len(before) + 5
    assert len(list((cache_dir / "tokenizers").glob("*/tokenizer.json"))) == tokenizers_before
    train = data / "train.en.gz"
    os.utime(train, ns=(train.stat().st_atime_ns, train.stat().st_mtime_ns + 10**9))  # new tokenizer
    _translation(data, cache_dir).setup("fit")
    assert len(list((cache_dir / "tokenizers").glob("*/tokenizer.json"))) == tokenizers_before + 1


@pytest.mark.parametrize("damage", ["truncated", "foreign", "incomplete", "garbage"])
def test_damaged_entry_is_reported_once_and_rebuilt(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    data = write_fixture(tmp_path / "text")
    first = _translation(data, tmp_path / "cache")
    first.setup("fit")
    expected = first.tokenized("train")[:]
    entry = next(p for p in (tmp_path / "cache" / "tokenized").iterdir() if "-train-" in p.name)
    arrow, manifest = sorted(entry.glob("*.arrow"))[-1], entry / cache.ENTRY_FILE
    if damage == "truncated":  # a copy cut short
        arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    elif damage == "foreign":  # another corpus's entry under this name
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "key": "0" * 64}))
    elif damage == "incomplete":  # a crash before entry.json was written
        manifest.unlink()
    else:  # right size, wrong bytes
        arrow.write_bytes(b"\0" * arrow.stat().st_size)
    with caplog.at_level(logging.WARNING, logger="data.cache"):
        again = _translation(data, tmp_path / "cache")
        again.setup("fit")
    warnings = [r.getMessage() for r in caplog.records if r.name == "data.cache"]
    assert len(warnings) == 1 and str(entry) in warnings[0] and "rebuilding" in warnings[0]
    assert again.tokenized("train")[:] == expected
    caplog.clear()
    _translation(data, tmp_path / "cache").setup("fit")  # rebuilt for good
    assert not [r for r in caplog.records if r.name == "data.cache"]


def _build_slowly(directory: Path, log_file: Path) -> tuple[datasets.Dataset, dict]:
    with open(log_file, "a") as handle:
        handle.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # long enough for the other process to arrive while this one builds
    dataset = datasets.Dataset.from_dict({"x": list(range(1000))})
    return dataset.map(lambda b: b, batched=True, cache_file_name=str(directory / "data.arrow")), {"n": 1}


def _prepare(directory: Path, log_file: Path) -> None:
    dataset, meta = cache.load_or_build(directory, "numbers", "k" * 64, lambda d: _build_slowly(d, log_file))
    assert dataset["x"][:] == list(range(1000)) and meta == {"n": 1}


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    log_file = tmp_path / "builds.txt"
    # fork: the workers need not import torch again (spawn would, for seconds each)
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )
    workers = [context.Process(target=_prepare, args=(tmp_path / "cache", log_file)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    assert len(log_file.read_text().split()) == 1  # one process built; the others waited and reused it
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == [
        "numbers-kkkkkkkkkkkkkkkk"
    ]


def test_loser_of_a_race_uses_the_winners_entry(tmp_path: Path) -> None:
    """Without a working lock (e.g. a network filesystem) two builders may finish: the rename decides."""
    directory = tmp_path / "cache"
    winner = directory / "numbers-kkkkkkkkkkkkkkkk"

    def build_and_lose(tmp: Path) -> tuple[datasets.Dataset, dict]:
        dataset, _ = _build_slowly(tmp, tmp_path / "builds.txt")
        # meanwhile another process, not seeing the lock, published the same entry
        winner.mkdir(parents=True)
        won = datasets.Dataset.from_dict({"x": list(range(1000))})
        won.map(lambda b: b, batched=True, cache_file_name=str(winner / "data.arrow"))
        files = {"data.arrow": (winner / "data.arrow").stat().st_size}
        manifest = {"key": "k" * 64, "rows": 1000, "columns": ["x"], "files": files, "meta": {"n": "winner"}}
        (winner / cache.ENTRY_FILE).write_text(json.dumps(manifest))
        return dataset, {"n": "loser"}

    dataset, meta = cache.load_or_build(directory, "numbers", "k" * 64, build_and_lose)
    assert meta == {"n": "winner"} and dataset["x"][:] == list(range(1000))
    assert [p.name for p in directory.iterdir() if not p.name.startswith(".")] == [winner.name]
    assert not list(directory.glob(".*.tmp"))  # the loser's files are gone


def test_hub_splits_are_cached_by_their_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hub data (here a local copy, as `load_dataset` memory-maps its download) is keyed by the loaded
    split's `datasets` fingerprint: the same download hits, another one misses."""
    synthetic = TranslationDataModule(
        synthetic_sizes={"train": 300, "val": 30, "test": 30}, show_progress=False
    )
    hub = datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict(
                {"translation": [{"en": s, "de": t} for s, t in zip(*synthetic.raw_split(split)[:].values())]}
            )
            for split in ("train", "val", "test")
        }
    )
    hub.save_to_disk(tmp_path / "hub")
    monkeypatch.setattr(
        datasets, "load_dataset", lambda name, config=None: datasets.load_from_disk(tmp_path / "hub")
    )
    settings = {
        **SETTINGS,
        "source": "hub",
        "hub_name": "wmt/x",
        "test_split": "test",
        "cache_dir": tmp_path / "c",
    }
    first = TranslationDataModule(**settings)
    first.setup(None)
    with monkeypatch.context() as patch:
        _forbid_preparation(patch)
        again = TranslationDataModule(**settings)
        again.setup(None)
        assert again.tokenized("train")[:] == first.tokenized("train")[:]
    hub["train"] = hub["train"].select(range(200))  # a new download
    hub.save_to_disk(tmp_path / "hub2")
    monkeypatch.setattr(
        datasets, "load_dataset", lambda name, config=None: datasets.load_from_disk(tmp_path / "hub2")
    )
    other = TranslationDataModule(**settings)
    other.setup("fit")
    assert len(other.tokenized("train")) == 200


def test_unwritable_cache_dir_is_one_data_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    with pytest.raises(sources.DataError, match=r"cannot write to the data cache: .*not-a-dir/tokenizers"):
        _translation(write_fixture(tmp_path / "text"), blocker).setup("fit")


def test_files_of_a_killed_builder_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / "cache" / ".numbers-kkkkkkkkkkkkkkkk.99999.tmp"
    stale.mkdir(parents=True)
    (stale / "data.arrow").write_bytes(b"half a corpus")
    dataset, _ = cache.load_or_build(
        tmp_path / "cache", "numbers", "k" * 64, lambda d: _build_slowly(d, tmp_path / "b")
    )
    assert len(dataset) == 1000 and not stale.exists()
