"""What a refused command must leave alone: a planted malicious pickle (loading it must not run it) and a
snapshot of a directory (to prove the command changed nothing in it); and how a command-line tool refuses
bad arguments (one line with its usage)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


class MaliciousPickle:
    """Unpickling this runs a shell command that creates `marker`: the classic malicious checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file below `directory` with its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()}


def assert_usage_error(
    capsys: pytest.CaptureFixture[str],
    main: Callable[[list[str]], int],
    argv: list[str],
    expected: str,
    prog: str,
) -> None:
    """`main(argv)` exits 1 with one stderr line that starts with `expected` and shows `prog`'s usage."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(expected) and f"(usage: {prog} " in captured.err
