"""Property-based tests (hypothesis) on random shapes and lengths: attention masks against a plain softmax
reference, and the token-budget batch sampler (each example exactly once, budget, ranks, resume).

tests/unit/test_batching.py already checks coverage + budget over random lengths and ranks; these add
exactly-once counting, rank disjointness and resuming from a random point of an epoch.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from data.batching import TokenBudgetBatchSampler
from transformer import MultiHeadAttention


@st.composite
def _attention_case(draw: st.DrawFn) -> dict:
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 6))
    S = draw(st.integers(1, 7))
    H = draw(st.sampled_from([1, 2, 4]))
    Dh = draw(st.sampled_from([1, 4]))
    lengths = draw(st.lists(st.integers(0, S), min_size=B, max_size=B))  # 0: every key is padding
    use_attn_mask = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return {"B": B, "T": T, "S": S, "H": H, "Dh": Dh, "lengths": lengths, "attn": use_attn_mask, "seed": seed}


@settings(max_examples=40, deadline=None)
@given(case=_attention_case(), need_weights=st.booleans())
def test_attention_masks_match_a_plain_softmax_reference(case: dict, need_weights: bool) -> None:
    B, T, S, H, Dh = (case[k] for k in ("B", "T", "S", "H", "Dh"))
    gen = torch.Generator().manual_seed(case["seed"])
    torch.manual_seed(case["seed"])
    module = MultiHeadAttention(H * Dh, H, batch_first=True).eval()
    query, memory = torch.randn(B, T, H * Dh, generator=gen), torch.randn(B, S, H * Dh, generator=gen)
    padding = torch.arange(S)[None, :] >= torch.tensor(case["lengths"])[:, None]  # (B, S) True = pad
    attn_mask = torch.rand(T, S, generator=gen) < 0.3 if case["attn"] else None  # (T, S) True = masked
    out, weights = module(
        query, memory, memory, key_padding_mask=padding, attn_mask=attn_mask, need_weights=True,
        average_attn_weights=False,
    )  # fmt: skip

    masked = padding[:, None, None, :].expand(B, H, T, S)  # (B, H, T, S)
    if attn_mask is not None:
        masked = masked | attn_mask
    empty = masked.all(-1)  # (B, H, T): rows with nothing to attend to
    # reference: project, split heads, softmax over the unmasked keys only, zeros for empty rows
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    q = (query @ w_q.T + b_q).view(B, T, H, Dh).transpose(1, 2)  # (B, H, T, Dh)
    k = (memory @ w_k.T + b_k).view(B, S, H, Dh).transpose(1, 2)  # (B, H, S, Dh)
    v = (memory @ w_v.T + b_v).view(B, S, H, Dh).transpose(1, 2)  # (B, H, S, Dh)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(Dh)).masked_fill(masked, -math.inf)  # (B, H, T, S)
    reference = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows: NaN -> 0
    context = (reference @ v).transpose(1, 2).reshape(B, T, H * Dh)  # (B, T, D)
    expected = context @ module.out_proj.weight.T + module.out_proj.bias

    assert weights is not None and torch.isfinite(weights).all() and torch.isfinite(out).all()
    assert (weights[masked] == 0).all()  # masked keys get exactly zero weight
    row_sums = weights.sum(-1)  # (B, H, T)
    torch.testing.assert_close(row_sums, (~empty).to(row_sums.dtype))  # 1, or 0 when fully masked
    torch.testing.assert_close(weights, reference)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    if not need_weights:  # the fused path (no weights) gives the same output
        fused, none = module(
            query, memory, memory, key_padding_mask=padding, attn_mask=attn_mask, need_weights=False
        )
        assert none is None
        torch.testing.assert_close(fused, out, atol=1e-5, rtol=1e-4)


_lengths = st.lists(st.integers(1, 40), min_size=1, max_size=150)


@settings(max_examples=40, deadline=None)
@given(lengths=_lengths, extra=st.integers(0, 200), seed=st.integers(0, 9), epoch=st.integers(0, 3))
def test_sampler_yields_every_example_exactly_once_within_budget(
    lengths: list[int], extra: int, seed: int, epoch: int
) -> None:
    max_tokens = max(lengths) + extra
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=seed)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    counts = Counter(i for batch in batches for i in batch)
    assert counts == Counter(range(len(lengths)))  # exactly once
    assert all(batch and len(batch) * max(lengths[i] for i in batch) <= max_tokens for batch in batches)
    assert len(batches) == len(sampler)


@settings(max_examples=40, deadline=None)
@given(lengths=_lengths, extra=st.integers(0, 200), world=st.integers(2, 4), drop_last=st.booleans())
def test_sampler_ranks_are_disjoint(lengths: list[int], extra: int, world: int, drop_last: bool) -> None:
    max_tokens = max(lengths) + extra
    try:
        samplers = [
            TokenBudgetBatchSampler(
                lengths, max_tokens, seed=1, num_replicas=world, rank=r, drop_last=drop_last
            )
            for r in range(world)
        ]
        per_rank = [list(sampler) for sampler in samplers]
    except ValueError as err:  # fewer batches than ranks with drop_last: refused, by design
        assert "leaves no batch" in str(err)
        assume(False)
    assert len({len(batches) for batches in per_rank}) == 1  # equal step counts: no rank waits forever
    batch_sets = [{tuple(b) for b in batches} for batches in per_rank]
    total = sum(len(batches) for batches in per_rank)
    distinct = len(set().union(*batch_sets))
    # a batch goes to one rank; only the padding that evens out the step counts repeats one
    assert total - distinct < world
    if not drop_last:
        covered = {i for batches in per_rank for b in batches for i in b}
        assert covered == set(range(len(lengths)))


@settings(max_examples=40, deadline=None)
@given(lengths=_lengths, extra=st.integers(0, 200), data=st.data())
def test_sampler_resumes_from_any_point_of_an_epoch(
    lengths: list[int], extra: int, data: st.DataObject
) -> None:
    max_tokens = max(lengths) + extra
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=4)
    sampler.set_epoch(1)
    full = list(sampler)
    stop = data.draw(st.integers(0, len(full)))
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=4)  # a fresh run, stopped after `stop`
    sampler.set_epoch(1)
    iterator = iter(sampler)
    seen = [next(iterator) for _ in range(stop)]
    resumed = TokenBudgetBatchSampler(lengths, max_tokens, seed=4)
    resumed.load_state_dict(sampler.state_dict())
    resumed.set_epoch(1)
    assert seen + list(resumed) == full  # no batch skipped or repeated
