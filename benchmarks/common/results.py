"""Results files: the folder they are kept in, and a stdout that also writes each line to one as it is
printed, so that a run cut off by a time limit leaves every finished row."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"  # dated files, a folder per group (train/...)


class ResultsLog(io.TextIOBase):
    """stdout, and the results file once it is named: what came before is written then, and every line
    after as it is printed (flushed), so a run cut off leaves every finished row."""

    def __init__(self, stdout: Any) -> None:
        self.stdout, self.pending, self.file = stdout, io.StringIO(), None
        self.path: Path | None = None

    def write(self, text: str) -> int:
        self.stdout.write(text)
        self.stdout.flush()
        target = self.file or self.pending
        target.write(text)
        target.flush()
        return len(text)

    def open(self, path: Path, command: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file, self.path = path.open("a", encoding="utf-8"), path
        self.file.write(f"$ {command}\n{self.pending.getvalue()}")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


@contextlib.contextmanager
def logged_stdout() -> Iterator[ResultsLog]:
    """stdout through a `ResultsLog` while the body runs (the body names the file with `open`); the file
    closed at the end, and, after a run that finished, where it was written."""
    log = ResultsLog(sys.stdout)
    try:
        with contextlib.redirect_stdout(log):
            yield log
    finally:
        log.close()
    if log.path is not None:
        print(f"written to {log.path}")
