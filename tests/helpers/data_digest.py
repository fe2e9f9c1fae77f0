"""Digests of what a datamodule feeds the model: tokenizers, token ids of every split, batches of two epochs.

Only the datamodules' public API is used, so the same function runs on older revisions of `data/`: the
golden values in the tests were computed with it on commit 859cf18 (before the prepared-data cache), from
a folder outside the repository (`python -c` puts the working directory first on sys.path), e.g.

    git worktree add /tmp/before 859cf18
    mkdir /tmp/digest && cp tests/helpers/data_digest.py /tmp/digest && cd /tmp/digest
    PYTHONPATH=/tmp/before python -c "from data_digest import main; main()"

(2026-11-28: the same values from this tree; ids and batches are hashed as int64 bytes since then.)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from data.datamodules import ClassificationDataModule, TranslationDataModule
from data.synthetic import make_synthetic_splits


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _sha_arrays(arrays: Iterable[tuple[str, Any]]) -> str:
    """A hash of named integer arrays: each name, shape and its values as int64 (what a tensor holds, not
    its dtype), in the order given. Hashing bytes: `tolist()` + JSON took half of a real-data digest."""
    sha = hashlib.sha256()
    for name, array in arrays:
        values = np.ascontiguousarray(np.asarray(array), dtype=np.int64)
        sha.update(f"{name}{values.shape};".encode())
        sha.update(values.tobytes())
    return sha.hexdigest()[:16]


def _batches(loader: Any) -> str:
    return _sha_arrays(
        (f"{i}.{key}", tensor.numpy())
        for i, batch in enumerate(loader)
        for key, tensor in sorted(batch.items())
    )


def _columns(rows: Any) -> Iterator[tuple[str, Any]]:
    """A split's id and label columns (an Arrow table) as arrays: a list column as its lengths and values."""
    import pyarrow.compute as pc

    for name in sorted(rows.column_names):
        if not name.endswith(("_ids", "id", "label")):
            continue
        column = rows.column(name)
        if hasattr(column.type, "value_type"):  # a list per example
            yield f"{name}.lengths", pc.list_value_length(column).to_numpy()
            column = pc.list_flatten(column)
        yield name, column.to_numpy()


def digest(dm: Any) -> dict[str, str]:
    """{"tokenizer", "<split>" for train/val/test, "train_epoch0", "train_epoch1", "val_batches"}: hashes."""
    dm.prepare_data()
    dm.setup("fit")
    sides = [dm.src_tokenizer] + ([dm.tgt_tokenizer] if hasattr(dm, "tgt_tokenizer") else [])
    result = {"tokenizer": _sha([tok.to_json() for tok in sides])}
    for role in ("train", "val", "test"):
        split = dm.splits[role]
        result[role] = _sha_arrays(_columns(dm.tokenized(split).with_format("arrow")[:]))
    loader = dm.train_dataloader()
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        result[f"train_epoch{epoch}"] = _batches(loader)
    result["val_batches"] = _batches(dm.val_dataloader())
    return result


def write_fixture(directory: Path) -> Path:
    """A small parallel corpus in the Multi30k layout (gz), with an empty pair and over-long lines."""
    directory.mkdir(parents=True, exist_ok=True)
    splits = make_synthetic_splits(7, {"train": 600, "val": 60, "test": 50})
    for split, (sources, targets) in splits.items():
        sources, targets = list(sources), list(targets)
        sources[3], targets[5] = "", ""  # dropped pairs
        sources[10] = " ".join([sources[10]] * 12)  # longer than max_len: dropped (train) / cut (eval)
        targets[11] = " ".join([targets[11]] * 12)
        for lang, lines in (("en", sources), ("de", targets)):
            with gzip.open(directory / f"{split}.{lang}.gz", "wt", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")
    return directory


def write_classification_fixture(directory: Path) -> Path:
    """A small labelled corpus in the GLUE TSV layout, from the synthetic task's sentences."""
    directory.mkdir(parents=True, exist_ok=True)
    splits = make_synthetic_splits(3, {"train": 500, "dev": 80})
    for split, (sources, _) in splits.items():
        lines = ["sentence\tlabel"] + [f"{text}\t{len(text) % 2}" for text in sources]
        lines[20] = "\t1"  # empty text: dropped
        lines[30] = f"{' '.join([sources[29]] * 12)}\t0"  # over-long
        (directory / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return directory


FIXTURE_SETTINGS: Mapping[str, Mapping[str, Any]] = {
    "synthetic": {"source": "synthetic", "synthetic_sizes": {"train": 500, "val": 50, "test": 40}},
    "parallel": {"source": "multi30k", "test_split": "test"},
    "pool": {"source": "multi30k", "test_split": "test", "pool_size": 64, "max_sentences": 9},
}
COMMON = {"vocab_size": 300, "max_tokens": 600, "max_len": 40, "show_progress": False, "seed": 3}


def fixture_datamodules(directory: Path, cache_dir: Path | None) -> dict[str, Any]:
    """The small-fixture datamodules whose digests the unit tests pin (data written into `directory`)."""
    parallel = write_fixture(directory / "parallel")
    tsv = write_classification_fixture(directory / "tsv")
    modules: dict[str, Any] = {}
    for name, settings in FIXTURE_SETTINGS.items():
        extra = {} if settings["source"] == "synthetic" else {"data_dir": parallel}
        modules[name] = TranslationDataModule(**settings, **extra, **COMMON, cache_dir=cache_dir)
    modules["tsv"] = ClassificationDataModule(
        "sst2", tsv, test_split="dev", **{**COMMON, "max_len": 30}, cache_dir=cache_dir
    )
    return modules


def real_datamodules(cache_dir: Path | None) -> dict[str, Any]:
    """Multi30k de-en and SST-2 as their experiments configure them (from $MULTI30K_DIR / $SST2_DIR)."""
    modules: dict[str, Any] = {}
    if os.environ.get("MULTI30K_DIR"):
        modules["multi30k"] = TranslationDataModule(
            "multi30k",
            os.environ["MULTI30K_DIR"],
            src_lang="de",
            tgt_lang="en",
            test_split="test_2016_flickr",
            vocab_size=8000,
            max_tokens=2048,
            max_len=128,
            show_progress=False,
            seed=42,
            cache_dir=cache_dir,
        )
    if os.environ.get("SST2_DIR"):
        modules["sst2"] = ClassificationDataModule(
            "sst2",
            os.environ["SST2_DIR"],
            test_split="dev",
            vocab_size=16000,
            max_tokens=4096,
            max_len=128,
            show_progress=False,
            seed=42,
            cache_dir=cache_dir,
        )
    return modules


def main() -> None:
    """Print the digests of the fixtures and (when their variables are set) of Multi30k and SST-2."""
    with tempfile.TemporaryDirectory() as tmp:
        modules = {**fixture_datamodules(Path(tmp), None), **real_datamodules(None)}
        print(json.dumps({name: digest(dm) for name, dm in modules.items()}, indent=1, sort_keys=True))
