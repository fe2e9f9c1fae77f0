"""The prepared-data cache: tokenized splits as `datasets` Arrow files under `cache_dir`, memory-mapped.

An entry is a directory `<name>-<key[:16]>/` with the Arrow file(s) and `entry.json` (the full key, the row
count, every file's size), written last. It is built under a temporary name and renamed into place by one
process at a time (a file lock; a process that waited reuses the winner's entry). A reader checks
`entry.json` against the files: a truncated or foreign entry is reported in one warning line and rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import datasets

from data.sources import DataError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the atomic rename alone keeps entries whole
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

ENTRY_FILE = "entry.json"
FORMAT_VERSION = 1  # bump when what an entry holds changes: older entries then simply miss


def cache_key(parts: Mapping[str, Any]) -> str:
    """A hex digest of `parts` (JSON-able: strings, numbers, lists, dicts), independent of key order."""
    text = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def file_identity(path: str | Path) -> list[Any]:
    """[absolute path, size, modification time in ns]: a rewritten, touched or moved file misses the cache."""
    resolved = Path(path).expanduser().resolve()
    stat = resolved.stat()
    return [str(resolved), stat.st_size, stat.st_mtime_ns]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if missing) for the duration of the block."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+b")  # noqa: SIM115 (closed below, after the lock is released)
    except OSError as err:  # an unwritable cache_dir, or a file in its place
        raise DataError(f"cannot write to the data cache: {path}: {err.strerror or err}") from err
    with handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("Waiting for another process to finish %s", path.stem)
                fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def load_or_build(
    directory: Path,
    name: str,
    key: str,
    build: Callable[[Path], tuple[datasets.Dataset, Mapping[str, Any]]],
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The entry `name` with `key` under `directory`, memory-mapped; `build(tmp_dir)` makes it when missing.

    `build` writes its Arrow file(s) into `tmp_dir` and returns the dataset backed by them and a JSON-able
    `meta`, which is stored in `entry.json` and returned with the dataset, also by later loads.
    """
    path = directory / f"{name}-{key[:16]}"
    found = _load(path, key, warn=False)
    if found is not None:
        log.info("Using cache entry %s (%d examples)", path, len(found[0]))
        return found
    try:
        with locked(directory / ".locks" / f"{path.name}.lock"):
            found = _load(path, key, warn=True)  # another process may have built it while we waited
            if found is not None:
                log.info("Using cache entry %s (%d examples), built by another process", path, len(found[0]))
                return found
            _remove(path)  # a truncated or foreign entry (already reported)
            for stale in directory.glob(f".{path.name}.*.tmp"):  # left by a builder that was killed
                _remove(stale)
            _build(directory, path, key, build)
    except Exception as err:  # an unwritable cache_dir, a full disk (also as reported by a worker process)
        # the note names what was written, in the words of transformer.disk (one line for a full disk)
        err.add_note(f"while writing the data cache entry {path.name} to {path}")
        if isinstance(err, OSError):
            raise DataError(f"cannot write the data cache entry {path}: {err.strerror or err}") from err
        raise
    found = _load(path, key, warn=True)
    if found is None:
        raise RuntimeError(f"cache entry {path} was written but cannot be read back")
    return found


def _build(
    directory: Path, path: Path, key: str, build: Callable[[Path], tuple[datasets.Dataset, Mapping[str, Any]]]
) -> None:
    """Build the entry in a temporary directory next to `path`, then rename it into place."""
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    tmp.mkdir(parents=True)
    try:
        start = time.perf_counter()
        dataset, meta = build(tmp)
        files = sorted({Path(f["filename"]).resolve() for f in dataset.cache_files})
        if not files or any(f.parent != tmp.resolve() for f in files):
            raise RuntimeError(f"build() of cache entry {path.name} must write its Arrow files into {tmp}")
        seconds = time.perf_counter() - start
        log.info("Prepared cache entry %s: %d examples in %.1f s", path, len(dataset), seconds)
        entry = {
            "key": key,
            "rows": len(dataset),
            "columns": list(dataset.column_names),
            "files": {f.name: f.stat().st_size for f in files},
            "meta": dict(meta),
            "seconds": round(seconds, 3),
        }
        del dataset  # its memory map points into tmp, which is about to move
        (tmp / ENTRY_FILE).write_text(json.dumps(entry, indent=1) + "\n")  # last: marks it complete
        _fsync(tmp, *tmp.iterdir())  # on disk before the rename publishes it
        try:
            os.rename(tmp, path)
        except OSError:  # a process without the lock (a filesystem without flock) won: use its entry
            _remove(tmp)
        _fsync(directory)
    except BaseException:
        _remove(tmp)
        raise


def _load(path: Path, key: str, warn: bool) -> tuple[datasets.Dataset, dict[str, Any]] | None:
    """The dataset and meta of the complete entry at `path`, or None (with `warn`, say why it is unusable)."""
    if not path.exists():
        return None
    problem = _check(path, key)
    if problem is None:
        entry = json.loads((path / ENTRY_FILE).read_text())
        try:
            parts = [datasets.Dataset.from_file(str(path / name)) for name in sorted(entry["files"])]
            dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        except Exception as err:  # e.g. pyarrow's ArrowInvalid on a damaged file of the right size
            problem = f"unreadable Arrow data ({type(err).__name__}: {err})"
        else:
            if len(dataset) == entry["rows"] and list(dataset.column_names) == entry["columns"]:
                return dataset, entry["meta"]
            problem = f"{len(dataset)} rows / columns {dataset.column_names}, entry.json says otherwise"
    if warn:
        log.warning("Cache entry %s is truncated or foreign (%s): rebuilding it", path, problem)
    return None


def _check(path: Path, key: str) -> str | None:
    """Why the entry at `path` cannot be used for `key`, or None when its files are complete."""
    try:
        entry = json.loads((path / ENTRY_FILE).read_text())
        files, rows = entry["files"], entry["rows"]
        if not isinstance(files, dict) or not files or not isinstance(rows, int):
            return f"malformed {ENTRY_FILE}"
    except FileNotFoundError:
        return f"no {ENTRY_FILE}"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {ENTRY_FILE}: {err}"
    if entry.get("key") != key:
        return "its key belongs to other data or settings"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {ENTRY_FILE} says {size}"
    return None


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def _fsync(*paths: Path) -> None:
    """Flush files (and directories' entries, e.g. a rename) to disk: a crash keeps only complete entries."""
    if os.name != "posix":
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
