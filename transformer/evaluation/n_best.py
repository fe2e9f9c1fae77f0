"""n-best lists in the Moses / Marian text format: `id ||| hypothesis ||| score`, one hypothesis a line,
id = the 0-based source line, a sentence's hypotheses best first, score = the search's own
(length-normalized) score; and a search's hypotheses as such lists of texts (`n_best_texts`), which
scoring and the inference API share."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from torch import Tensor

from transformer.disk import write_text


def n_best_lines(index: int, hypotheses: Sequence[tuple[str, float]]) -> list[str]:
    """One source line's hypotheses [(text, score), ...] -> its n-best lines (newline-terminated)."""
    return [f"{index} ||| {' '.join(text.split())} ||| {score:.6f}\n" for text, score in hypotheses]


def write_n_best(path: Path, n_best: Iterable[Sequence[tuple[str, float]]]) -> Path:
    """Every sentence's n-best list, in split order, to `path` (whole, or not at all on a full disk)."""
    lines = [line for index, hypotheses in enumerate(n_best) for line in n_best_lines(index, hypotheses)]
    return write_text(path, "".join(lines), "the n-best list")


def n_best_texts(
    tokens: Tensor,
    scores: Tensor,
    decode_ids: Callable[[list[list[int]]], list[str]],
    eos_id: int,
    pad_id: int,
) -> list[list[tuple[str, float]]]:
    """A search's (B, N, L) hypotheses and (B, N) scores -> per sentence [(text, score), ...], best
    first; the -inf rows of a sentence with fewer than N ended hypotheses are left out (the first one
    always stays, as the sentence's output)."""
    batch, n, _ = tokens.shape
    ids = [until_eos(row, eos_id, pad_id) for row in tokens.reshape(batch * n, -1)]
    texts, values = decode_ids(ids), scores.tolist()
    return [
        [(texts[b * n + k], values[b][k]) for k in range(n) if k == 0 or math.isfinite(values[b][k])]
        for b in range(batch)
    ]


def until_eos(row: Tensor, eos_id: int, pad_id: int) -> list[int]:
    """A hypothesis row -> its ids up to and including the first EOS (without EOS: the non-pad ids)."""
    ids = row.tolist()
    if eos_id in ids:
        return ids[: ids.index(eos_id) + 1]
    return [i for i in ids if i != pad_id]
