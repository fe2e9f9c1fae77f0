"""Writes that leave a whole file or none, and the one line that a full disk ends a command with.

Every writer names what it writes: `writing(path, what)` adds the note `while writing WHAT to PATH` to the
exception that escapes it (and removes the file or directory the block created: it may be half-written);
`data/`, which imports nothing of `transformer/`, adds the same note by hand. `disk_full_line(err)` is the
one mechanism that turns a full disk (ENOSPC, EDQUOT, EROFS: also when a library wrapped it in its own
error, or a worker process reported it as text) into one line naming the path, the cause, the free space
and what needed writing. The entry points (`transformer.cli.errors`) and `aiayn-export` print it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

__all__ = [
    "CAUSES", "disk_full_line", "human_size", "room_for", "tensor_bytes", "write_text", "writing",
    "writing_aside",
]  # fmt: skip

# the errors a user fixes by freeing space (or pointing the output elsewhere), in the words they read
CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
}
# the same errors once a library or worker process turned them into text
_AS_TEXT = re.compile(r"\[Errno (\d+)\]|\(os error (\d+)\)|errno[ =:]+(\d+)", re.IGNORECASE)
_WORDS = {
    "no space left on device": errno.ENOSPC,
    "database or disk is full": errno.ENOSPC,  # SQLite (e.g. an Optuna study's storage)
    "disk quota exceeded": errno.EDQUOT,
    "read-only file system": errno.EROFS,
}
_NOTE = re.compile(r"^while writing (?P<what>.+?) to (?P<path>.+)$")


@contextlib.contextmanager
def writing(path: str | Path, what: str) -> Iterator[Path]:
    """The block writes `what` (e.g. "the checkpoint of 12.8 MB") to `path`: an exception escaping it gets
    the note that names both, and what the block created at `path` (a file or a directory) is removed,
    since it may be half-written. What was at `path` before is the caller's (write it with `write_text`)."""
    path = Path(path)
    existed = path.exists()
    try:
        yield path
    except BaseException as err:  # a Ctrl-C too leaves no half-written file
        if not existed:
            _remove(path)
        if isinstance(err, Exception):
            err.add_note(f"while writing {what} to {path}")
        if isinstance(err, Exception) and any(isinstance(e, KeyboardInterrupt) for e in _chain(err)):
            # a Ctrl-C that a library turned into its own error while unwinding (torch.save's zip writer:
            # "unexpected pos"): still a Ctrl-C for the caller (Lightning's graceful stop, a sweep's)
            raise KeyboardInterrupt from err
        raise


def write_text(path: str | Path, text: str, what: str) -> Path:
    """Write `text` to `path` through a temporary file beside it, renamed over it when complete: a full
    disk leaves the earlier file whole (and no temporary file)."""
    with writing_aside(path, what, newline="") as handle:
        handle.write(text)
    return Path(path)


@contextlib.contextmanager
def writing_aside(path: str | Path, what: str, newline: str | None = None) -> Iterator[TextIO]:
    """A text handle for a file written as it goes (a stream of translations; `write_text` in one piece):
    the text goes to a temporary file beside `path`, renamed over it when the block ends. An exception or
    a Ctrl-C escaping the block leaves `path` as it was (an earlier file whole, or nothing) and no
    temporary file. `newline` as `open`'s."""
    path = Path(path)
    with writing(path, what):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline=newline) as handle:
                yield handle
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)


def disk_full_line(err: BaseException, where: str | Path | None = None, then: str = "") -> str | None:
    """The one line (without `error: `) for `err` when a full disk, exceeded quota or read-only filesystem
    caused it, else None. The path and what was written come from the writer's note (else the error's
    file name, else `where`); `then` says what to do once there is room."""
    chain = _chain(err)  # outermost first
    code = next((c for c in map(_errno, reversed(chain)) if c is not None), None)
    if code is None:
        return None
    what, path = None, None
    for link in reversed(chain):  # the innermost writer's note: the first write that failed
        notes = (_NOTE.match(n) for n in getattr(link, "__notes__", ()) if isinstance(n, str))
        found = next((m for m in notes if m), None)
        if found:
            what, path = found["what"], Path(found["path"])
            break
    if path is None:
        named = [e.filename for e in reversed(chain) if isinstance(e, OSError) and e.filename]
        path = Path(os.fsdecode(named[0])) if named else (Path(where) if where is not None else None)
    line = f"{path}: {CAUSES[code]}" if path is not None else CAUSES[code]
    free = _free_bytes(path) if path is not None and code == errno.ENOSPC else None
    if free is not None:
        line += f" ({human_size(free)} free)"
    if what:
        line += f" writing {what}"
    if code == errno.EROFS:  # no space to free: the path must change
        then = "choose a directory on a writable filesystem"
    return f"{line}; {then}" if then else line


def room_for(directory: str | Path, needed: int, what: str) -> None:
    """Raise the full-disk OSError (with its note) now if the filesystem of `directory` has less than
    `needed` bytes free: refused before the long work, in the same words as a write that failed."""
    free = _free_bytes(Path(directory))
    if free is not None and free < needed:
        short = f"{CAUSES[errno.ENOSPC]}: {human_size(free)} free, needs {human_size(needed)}"
        err = OSError(errno.ENOSPC, short)
        err.add_note(f"while writing {what} to {directory}")
        raise err


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in `obj` (nested dicts, lists, tuples), each storage once: what its
    checkpoint file needs, give or take the pickled rest (a few kB)."""
    storages: dict[int, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(obj)
    return sum(storages.values())


def human_size(size: int) -> str:
    """Bytes in the unit `df -H` would use: 12.8 MB, 3.1 GB, 512 bytes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from or while handling, each once."""
    chain: list[BaseException] = []
    link: BaseException | None = err
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


def _errno(err: BaseException) -> int | None:
    if isinstance(err, OSError) and err.errno in CAUSES:
        return err.errno
    text = str(err)
    for match in _AS_TEXT.finditer(text):
        code = int(next(g for g in match.groups() if g))
        if code in CAUSES:
            return code
    lowered = text.lower()
    return next((code for words, code in _WORDS.items() if words in lowered), None)


def _free_bytes(path: Path) -> int | None:
    """Free bytes for an unprivileged writer on the filesystem that holds (or would hold) `path`."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask
