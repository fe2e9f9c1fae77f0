"""Results files: the folder they are kept in, and a stdout that also writes each line to one as it is
printed, so that a run cut off by a time limit leaves every finished row."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"  # dated files, kept with their history


class ResultsLog(io.TextIOBase):
    """stdout, and the results file once it is named: what came before is written then, and every line
    after as it is printed (flushed), so a run cut off leaves every finished row."""

    def __init__(self, stdout: Any) -> None:
        self.stdout, self.pending, self.file = stdout, io.StringIO(), None

    def write(self, text: str) -> int:
        self.stdout.write(text)
        self.stdout.flush()
        target = self.file or self.pending
        target.write(text)
        target.flush()
        return len(text)

    def open(self, path: Path, command: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")
        self.file.write(f"$ {command}\n{self.pending.getvalue()}")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
