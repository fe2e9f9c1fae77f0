"""Markdown for the reports: tables with escaped cells, and a report assembled block by block (the
report.md of `evaluate.py` and of the sweep report)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MarkdownReport", "markdown_table", "one_line"]


def one_line(text: str) -> str:
    """`text` with its line breaks turned into spaces."""
    return " ".join(text.splitlines())


def _cell(value: object) -> str:
    if isinstance(value, float):
        text = f"{value:.2f}" if math.isfinite(value) else str(value)
    else:
        text = str(value)
    # a pipe would end the cell and a newline the row; backticks stay literal text
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; floats get two decimals, pipes and newlines are escaped."""
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells (the header's), got {[len(r) for r in rows]}")
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class MarkdownReport:
    """Blocks of Markdown written to one file; images are referenced relative to that file."""

    def __init__(self, title: str) -> None:
        self.blocks: list[str] = [f"# {title}"]

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(f"{'#' * level} {text}")

    def text(self, text: str) -> None:
        self.blocks.append(text)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        self.blocks.append(markdown_table(header, rows))

    def code(self, text: str) -> None:
        fence = "````" if "```" in text else "```"
        self.blocks.append(f"{fence}\n{text}\n{fence}")

    def image(self, path: str | Path, alt: str, relative_to: str | Path) -> None:
        self.blocks.append(f"![{_cell(alt)}]({Path(path).relative_to(relative_to).as_posix()})")

    def to_markdown(self) -> str:
        return "\n\n".join(self.blocks) + "\n"

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_markdown(), encoding="utf-8")
        return path
