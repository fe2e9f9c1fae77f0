"""What a refused command must leave alone: a planted malicious pickle (loading it must not run it) and a
snapshot of a directory (to prove the command changed nothing in it)."""

from __future__ import annotations

import os
from pathlib import Path


class MaliciousPickle:
    """Unpickling this runs a shell command that creates `marker`: the classic malicious checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file below `directory` with its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()}
