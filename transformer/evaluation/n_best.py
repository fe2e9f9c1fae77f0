"""n-best lists in the Moses / Marian text format: `id ||| hypothesis ||| score`, one hypothesis a line,
id = the 0-based source line, a sentence's hypotheses best first, score = the search's own
(length-normalized) score."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from transformer.disk import write_text


def n_best_lines(index: int, hypotheses: Sequence[tuple[str, float]]) -> list[str]:
    """One source line's hypotheses [(text, score), ...] -> its n-best lines (newline-terminated)."""
    return [f"{index} ||| {' '.join(text.split())} ||| {score:.6f}\n" for text, score in hypotheses]


def write_n_best(path: Path, n_best: Iterable[Sequence[tuple[str, float]]]) -> Path:
    """Every sentence's n-best list, in split order, to `path` (whole, or not at all on a full disk)."""
    lines = [line for index, hypotheses in enumerate(n_best) for line in n_best_lines(index, hypotheses)]
    return write_text(path, "".join(lines), "the n-best list")
