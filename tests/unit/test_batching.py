"""Token-budget batching: coverage, budget, shuffling, determinism, DDP splits, exact resume; collates."""

import random
from collections import Counter

import datasets
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from data.batching import (
    ClassificationCollator,
    IndexedBatches,
    TokenBudgetBatchSampler,
    TranslationCollator,
    pad_sequences,
)

_RNG = random.Random(0)
LENGTHS = [_RNG.randint(3, 40) for _ in range(1000)]


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _cost(batch: list[int], lengths: list[int]) -> int:
    return len(batch) * max(lengths[i] for i in batch)


@pytest.mark.parametrize("pool_size", [None, 100, 1])
def test_each_example_once_per_epoch_within_budget(pool_size: int | None) -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 400, seed=1, pool_size=pool_size)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert sorted(_flat(batches)) == list(range(len(LENGTHS)))
        assert max(_cost(b, LENGTHS) for b in batches) <= 400
        assert len(batches) == len(sampler)


def test_bucketing_wastes_little_padding() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 400, seed=1)
    padded = sum(_cost(b, LENGTHS) for b in sampler)
    assert sum(LENGTHS) / padded > 0.95


def test_reshuffled_each_epoch_and_deterministic_per_seed() -> None:
    a = TokenBudgetBatchSampler(LENGTHS, 400, seed=1)
    b = TokenBudgetBatchSampler(LENGTHS, 400, seed=1)
    epoch0 = list(a)
    assert epoch0 == list(b) == list(a)  # same epoch, same batches (until set_epoch)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != epoch0
    assert sorted(map(sorted, a)) != sorted(map(sorted, epoch0))  # new batch contents, not just a new order
    assert list(TokenBudgetBatchSampler(LENGTHS, 400, seed=2)) != epoch0
    # Batch order is shuffled: lengths do not just increase through the epoch.
    longest = [max(LENGTHS[i] for i in batch) for batch in epoch0]
    assert longest != sorted(longest)


def test_constant_batch_count_with_one_pool() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 400, seed=1)
    counts = set()
    for epoch in range(5):
        sampler.set_epoch(epoch)
        counts.add(len(sampler))
    assert len(counts) == 1  # Lightning reads len() once per fit


def test_eval_order_sorted_and_deterministic() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 400, shuffle=False)
    batches = list(sampler)
    flat = _flat(batches)
    assert [LENGTHS[i] for i in flat] == sorted(LENGTHS)
    sampler.set_epoch(3)
    assert list(sampler) == batches


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_disjoint_batches_and_equal_counts(drop_last: bool, world: int) -> None:
    per_rank = [
        list(TokenBudgetBatchSampler(LENGTHS, 400, seed=5, num_replicas=world, rank=r, drop_last=drop_last))
        for r in range(world)
    ]
    assert len({len(batches) for batches in per_rank}) == 1
    single = list(TokenBudgetBatchSampler(LENGTHS, 400, seed=5))
    all_batches = [tuple(b) for batches in per_rank for b in batches]
    if drop_last:  # strictly disjoint; at most world - 1 batches left out
        assert len(set(_flat(per_rank[0])) & set(_flat(per_rank[1]))) == 0
        assert len(set(all_batches)) == len(all_batches) > len(single) - world
        assert len(per_rank[0]) == len(single) // world
    else:  # everything covered; the last few batches repeat early ones to even out the counts
        assert set(all_batches) == {tuple(b) for b in single}
        assert len(all_batches) - len(single) < world


def test_resume_mid_epoch_exactly() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 400, seed=3, num_replicas=2, rank=1)
    sampler.set_epoch(2)
    full = list(sampler)
    iterator = iter(sampler)
    seen = [next(iterator) for _ in range(5)]
    state = sampler.state_dict()
    assert state == {"epoch": 2, "batches_yielded": 5}

    resumed = TokenBudgetBatchSampler(LENGTHS, 400, seed=3, num_replicas=2, rank=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # Lightning calls this at the start of the resumed epoch: it must not reset
    assert len(resumed) == len(full)
    assert seen + list(resumed) == full
    resumed.set_epoch(3)
    sampler.set_epoch(3)
    assert list(resumed) == list(sampler)  # later epochs continue normally


def test_max_tokens_smaller_than_an_example() -> None:
    with pytest.raises(ValueError, match=r"max_tokens=30 is smaller than example 2 of length 31"):
        TokenBudgetBatchSampler([5, 6, 31, 7], 30)


def test_epoch_lengths_repack_every_epoch() -> None:
    """Lengths that change per epoch (BPE-dropout): each epoch is packed and bucketed by its own."""
    per_epoch = {
        e: [length + random.Random(e * 10_000 + i).randint(0, 8) for i, length in enumerate(LENGTHS)]
        for e in range(3)
    }
    sampler = TokenBudgetBatchSampler(LENGTHS, 400, seed=1, epoch_lengths=per_epoch.__getitem__)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert sorted(_flat(batches)) == list(range(len(LENGTHS)))
        assert max(_cost(b, per_epoch[epoch]) for b in batches) <= 400
        assert sum(per_epoch[epoch]) / sum(_cost(b, per_epoch[epoch]) for b in batches) > 0.95
    bad = TokenBudgetBatchSampler(LENGTHS, 400, epoch_lengths=lambda epoch: LENGTHS[:-1])
    with pytest.raises(
        ValueError, match=r"epoch_lengths\(0\) must give 1000 lengths of at most max_tokens=400"
    ):
        list(bad)


def test_max_sentences_caps_batch_size() -> None:
    batches = list(TokenBudgetBatchSampler([1] * 50, 1000, max_sentences=8))
    assert max(map(len, batches)) == 8 and len(batches) == 7


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=200),
    extra=st.integers(0, 300),
    pool_size=st.one_of(st.none(), st.integers(1, 64)),
    world=st.integers(1, 4),
    seed=st.integers(0, 5),
)
def test_property_coverage_and_budget(
    lengths: list[int], extra: int, pool_size: int | None, world: int, seed: int
) -> None:
    max_tokens = max(lengths) + extra
    samplers = [
        TokenBudgetBatchSampler(
            lengths, max_tokens, seed=seed, pool_size=pool_size, num_replicas=world, rank=r
        )
        for r in range(world)
    ]
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1
    assert set(_flat([b for batches in per_rank for b in batches])) == set(range(len(lengths)))
    assert all(_cost(b, lengths) <= max_tokens for batches in per_rank for b in batches)


# -- collates -----------------------------------------------------------------------------------------
def test_pad_sequences() -> None:
    assert pad_sequences([[1, 5, 2], [1, 2]], pad_id=0).tolist() == [[1, 5, 2], [1, 2, 0]]
    rng = np.random.default_rng(0)
    for _ in range(20):  # ragged rows (an empty one too), lists or arrays, ids up to 2**40
        rows = [rng.integers(0, 2**40, size=rng.integers(0, 9)) for _ in range(rng.integers(1, 7))]
        rows = [row.tolist() if i % 2 else row for i, row in enumerate(rows)]
        padded = pad_sequences(rows, pad_id=7)
        longest = max(len(row) for row in rows)
        assert padded.dtype == torch.long and padded.shape == (len(rows), longest)
        assert padded.tolist() == [list(row) + [7] * (longest - len(row)) for row in rows]


def test_translation_collate() -> None:
    examples = [
        {"src_ids": [1, 7, 8, 2], "tgt_ids": [1, 9, 2], "id": 4},
        {"src_ids": [1, 7, 2], "tgt_ids": [1, 9, 10, 11, 2], "id": 0},
    ]
    batch = TranslationCollator()(examples)
    assert batch["src"].tolist() == [[1, 7, 8, 2], [1, 7, 2, 0]]
    assert batch["src_padding_mask"].tolist() == [[False] * 4, [False] * 3 + [True]]
    assert batch["tgt_in"].tolist() == [[1, 9, 0, 0], [1, 9, 10, 11]]
    assert batch["tgt_out"].tolist() == [[9, 2, 0, 0], [9, 10, 11, 2]]
    assert batch["tgt_padding_mask"].tolist() == [[False, False, True, True], [False] * 4]
    assert batch["id"].tolist() == [4, 0]
    assert all(t.dtype == torch.long for k, t in batch.items() if not k.endswith("mask"))
    source_only = TranslationCollator()([{"src_ids": [1, 2], "id": 0}])
    assert set(source_only) == {"src", "src_padding_mask", "id"}


def test_classification_collate() -> None:
    batch = ClassificationCollator()(
        [{"src_ids": [1, 5, 2], "label": 1, "id": 3}, {"src_ids": [1, 2], "label": 0, "id": 1}]
    )
    assert set(batch) == {"src", "src_padding_mask", "label", "id"}
    assert batch["label"].tolist() == [1, 0] and batch["src"].shape == (2, 3)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_dataloader_with_sampler_yields_each_example_once(num_workers: int) -> None:
    lengths = LENGTHS[:200]
    dataset = datasets.Dataset.from_dict(
        {"src_ids": [[1] * n for n in lengths], "tgt_ids": [[1, 2]] * 200, "id": list(range(200))}
    )
    sampler = TokenBudgetBatchSampler(lengths, 200, seed=0)
    loader = DataLoader(
        IndexedBatches(dataset),
        sampler=sampler,
        batch_size=None,
        collate_fn=TranslationCollator(),
        num_workers=num_workers,
    )
    ids = Counter(i for batch in loader for i in batch["id"].tolist())
    assert ids == Counter(range(200))
    assert len(loader) == len(sampler)
    # Plain lists of example dicts work too; an integer gives a whole batch (or a batch of one).
    assert IndexedBatches([{"id": 5}, {"id": 6}])[1] == [{"id": 6}]
    fixed = IndexedBatches([{"id": 5}, {"id": 6}, {"id": 7}], batches=[[2, 0], [1]])
    assert len(fixed) == 2 and fixed[0] == [{"id": 7}, {"id": 5}]


@pytest.mark.parametrize(("world", "max_tokens"), [(2, 400), (3, 400), (4, 10_000), (3, 100_000)])
def test_evaluation_deals_batches_to_ranks_without_repeats(world: int, max_tokens: int) -> None:
    """even_batches=False (validation and test under DDP): rank r gets batches r, r + N, ... of the
    one-process list, every example exactly once, counts within one of each other; with fewer batches
    than ranks the batches are cut (within the budget) so that every rank gets one."""
    single = list(TokenBudgetBatchSampler(LENGTHS, max_tokens, shuffle=False))
    per_rank = [
        list(
            TokenBudgetBatchSampler(
                LENGTHS, max_tokens, shuffle=False, num_replicas=world, rank=r, even_batches=False
            )
        )
        for r in range(world)
    ]
    assert sorted(_flat([b for batches in per_rank for b in batches])) == list(range(len(LENGTHS)))
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1 and min(map(len, per_rank)) >= 1
    for batches in per_rank:
        assert all(len(b) * max(LENGTHS[i] for i in b) <= max_tokens for b in batches)
    if len(single) >= world:  # exactly the one-process batches, dealt round robin
        assert all(per_rank[r] == single[r::world] for r in range(world))
    shares = [len(_flat(batches)) / len(LENGTHS) for batches in per_rank]
    assert max(shares) < 1.5 / world  # each rank about 1/N of the sentences


def test_evaluation_with_fewer_examples_than_ranks_repeats_only_the_last() -> None:
    per_rank = [
        list(TokenBudgetBatchSampler([5, 7], 100, shuffle=False, num_replicas=3, rank=r, even_batches=False))
        for r in range(3)
    ]
    assert per_rank == [[[0]], [[1]], [[1]]]  # every rank one batch (an empty one would skip the loop)
