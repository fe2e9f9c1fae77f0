"""Texts -> padded source batches by a token budget, sorted by length: the batches `evaluate.py` translates
in (`TokenBudgetDataModule.text_dataloader`, made of the same `data.batching` parts), so that a sentence
decodes the same here as there. Each batch keeps the input positions of its rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

from data.batching import TokenBudgetBatchSampler, truncate

__all__ = ["token_budget_batches"]

Collate = Callable[[Sequence[Mapping[str, Any]]], dict[str, Tensor]]


def token_budget_batches(
    ids: Sequence[Sequence[int]], *, max_len: int, max_tokens: int, collate: Collate
) -> Iterator[dict[str, Tensor]]:
    """Token ids of texts (each [BOS .. EOS], cut to `max_len` keeping EOS) -> `collate`d batches
    {"src" (B, S), "src_padding_mask" (B, S), "id" (B,): positions in `ids`} of at most `max_tokens`
    padded tokens, shortest first (ties in input order)."""
    if not ids:
        return
    examples = [{"src_ids": truncate(seq, max_len), "id": i} for i, seq in enumerate(ids)]
    sampler = TokenBudgetBatchSampler([len(ex["src_ids"]) for ex in examples], max_tokens, shuffle=False)
    for indices in sampler:
        yield collate([examples[i] for i in indices])
