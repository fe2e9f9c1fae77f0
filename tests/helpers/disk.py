"""A disk that fills in-process: writes under one directory fail with ENOSPC once a byte budget is spent."""

from __future__ import annotations

import builtins
import errno
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


class _Disk:
    def __init__(self, root: Path, budget: int) -> None:
        self.root, self.left = str(root.resolve()), budget

    def holds(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + os.sep)


class _Filling:
    """A file on `disk`: writes beyond its budget fail with ENOSPC (the part that fits is written)."""

    def __init__(self, handle: Any, disk_: _Disk) -> None:
        self._handle, self._disk = handle, disk_

    def write(self, data: Any) -> int:
        if len(data) > self._disk.left:
            self._handle.write(data[: self._disk.left])
            self._disk.left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.left -= len(data)
        return self._handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __iter__(self) -> Any:
        return iter(self._handle)

    def __enter__(self) -> _Filling:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()


def filling_disk(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path, int], None]:
    """`fill(directory, budget)`: from now on, files under `directory` take `budget` more bytes."""

    def fill(root: Path, budget: int) -> None:
        state = _Disk(root, budget)
        real_open, real_fdopen = builtins.open, os.fdopen

        def filling(handle: Any, path: str, mode: str) -> Any:
            writes = any(c in str(mode) for c in "wax+")
            return _Filling(handle, state) if writes and state.holds(path) else handle

        def opener(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = real_open(file, mode, *args, **kwargs)
            path = os.path.abspath(os.fsdecode(file)) if not isinstance(file, int) else ""
            return filling(handle, os.path.realpath(path) if path else path, mode)

        def fdopener(fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = real_fdopen(fd, mode, *args, **kwargs)
            return filling(handle, os.readlink(f"/proc/self/fd/{fd}"), mode)

        monkeypatch.setattr(builtins, "open", opener)
        monkeypatch.setattr(io, "open", opener)
        monkeypatch.setattr(os, "fdopen", fdopener)

    return fill
