"""What every source shares: `DataError`, reading UTF-8 text files (plain or .gz), streaming rows into a
memory-mapped Arrow file, finding a split's file in a directory, and a hub dataset's splits by our names."""

from __future__ import annotations

import errno
import gzip
import itertools
import uuid
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
from datasets.arrow_writer import ArrowWriter

CHUNK_ROWS = 50_000  # rows read and written at a time when streaming a file into Arrow


class DataError(ValueError):
    """Input data that cannot be used as it is: the message names the file, line or value and the fix."""


def iter_lines(path: str | Path, strip: bool = True) -> Iterator[str]:
    """Lines of a UTF-8 file (plain or .gz), stripped of surrounding whitespace (or only of the newline)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing file {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"{path}:{number}: invalid UTF-8 ({err.reason} at byte {err.start} of the line)"
                    ) from None
                yield text.strip() if strip else text.rstrip("\r\n")
    except (OSError, EOFError, zlib.error) as err:  # e.g. a truncated or non-gzip .gz file
        raise DataError(f"cannot read {path}: {err}") from None


def read_lines(path: str | Path, strip: bool = True) -> list[str]:
    """All of `iter_lines` as a list (small files; corpora are streamed)."""
    return list(iter_lines(path, strip))


def arrow_dataset(rows: Iterable[Sequence[Any]], features: datasets.Features) -> datasets.Dataset:
    """Write `rows` (one value per column of `features`, in order) into an Arrow file and memory-map it.

    Rows are written `CHUNK_ROWS` at a time into a file in `datasets`' temporary directory, removed when
    the process ends: a corpus is streamed from its text files to disk without ever being a Python list.
    """
    columns = list(features)
    directory = Path(datasets.fingerprint.get_temporary_cache_files_directory())
    path = directory / f"raw-{uuid.uuid4().hex}.arrow"
    rows = iter(rows)
    with ArrowWriter(features=features, path=str(path), writer_batch_size=CHUNK_ROWS) as writer:
        while chunk := list(itertools.islice(rows, CHUNK_ROWS)):
            writer.write_batch({column: [row[i] for row in chunk] for i, column in enumerate(columns)})
        writer.finalize()
    return datasets.Dataset.from_file(str(path))


def check_dir(data_dir: str | Path, layout: str) -> Path:
    """`data_dir` as a Path, or `DataError` when it is not a directory (naming the expected `layout`)."""
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise DataError(f"data directory {directory} does not exist (expected files named {layout})")
    return directory


def find_file(directory: Path, name: str) -> Path | None:
    """`name` or `name` + ".gz" (or without ".gz") inside `directory`, whichever exists."""
    stem = name.removesuffix(".gz")
    for candidate in (directory / name, directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def hub_splits(
    name: str, config: str | None, splits: Sequence[str], split_names: Mapping[str, str] | None
) -> Iterator[tuple[str, str, datasets.Dataset]]:
    """(our split, the hub's name for it, its table) for each of `splits`, from hub dataset `name`."""
    split_names = split_names or {}
    try:
        hub = datasets.load_dataset(name, config)
    except (OSError, ValueError) as err:  # not found, no network, unknown config: one line, not a traceback
        if getattr(err, "errno", None) == errno.ENOSPC:
            raise  # a full disk is reported as such (cli.errors.disk_full)
        raise DataError(
            f"cannot load hub dataset {name!r} (config {config!r}): {' '.join(str(err).split())}"
        ) from err
    for split in splits:
        hub_split = split_names.get(split, split)
        if hub_split not in hub:
            raise DataError(f"hub dataset {name!r} has no split {hub_split!r}; it has {sorted(hub)}")
        yield split, hub_split, hub[hub_split]
