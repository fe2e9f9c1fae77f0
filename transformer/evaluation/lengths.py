"""BLEU by source length (words): the report's table and chart, for the whole split and (a multilingual
split) for each direction. A source's target-language label is not one of its words."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import sacrebleu

from transformer.evaluation.scoring import TranslationResult

__all__ = ["LengthBucket", "bleu_by_length", "bleu_by_length_by_direction"]


@dataclass
class LengthBucket:
    """Corpus BLEU of the sentences whose source has `low`..`high` words (`high` None: no limit)."""

    low: int
    high: int | None
    count: int
    bleu: float

    @property
    def label(self) -> str:
        return f"{self.low}+" if self.high is None else f"{self.low}-{self.high}"


def bleu_by_length(
    sources: Sequence[str],
    hypotheses: Sequence[str],
    references: Sequence[str],
    edges: Sequence[int],
    ignore: Collection[str] = (),
) -> list[LengthBucket]:
    """Corpus BLEU per source-length bucket (words): edges [10, 20] -> 1-10, 11-20, 21+ (empty: left out).
    Words in `ignore` (a multilingual source's target-language label) are not counted."""
    bounds = sorted({int(e) for e in edges})
    if not bounds or bounds[0] < 1:
        raise ValueError(f"length bucket edges must be positive integers, got {list(edges)}")
    ranges = [(low + 1, high) for low, high in zip([0, *bounds[:-1]], bounds)]
    skipped = set(ignore)
    words = [sum(word not in skipped for word in s.split()) for s in sources]
    buckets: list[LengthBucket] = []
    for low, high in [*ranges, (bounds[-1] + 1, None)]:
        chosen = [i for i, n in enumerate(words) if low <= n and (high is None or n <= high)]
        if chosen:
            hyps = [hypotheses[i] for i in chosen]
            refs = [references[i] for i in chosen]
            score = sacrebleu.corpus_bleu(hyps, [refs]).score
            buckets.append(LengthBucket(low, high, len(chosen), score))
    return buckets


def bleu_by_length_by_direction(
    result: TranslationResult, edges: Sequence[int]
) -> dict[str, list[LengthBucket]]:
    """`bleu_by_length` of each direction of a multilingual result (sorted); {} for a single direction."""
    by_direction: dict[str, list[LengthBucket]] = {}
    for direction in sorted(set(result.directions)):
        rows = [i for i, d in enumerate(result.directions) if d == direction]
        by_direction[direction] = bleu_by_length(
            [result.sources[i] for i in rows],
            [result.hypotheses[i] for i in rows],
            [result.references[i] for i in rows],
            edges,
            result.source_labels,
        )
    return by_direction
