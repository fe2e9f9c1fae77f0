"""The end-to-end epoch of bench_train.py: Multi30k training pairs (or a stand-in with Multi30k-like
lengths) as our bucketed token-budget batches and as random batches of a fixed size."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.common.references import Batch, batch_from_ids
from benchmarks.train.runners import VOCAB


def multi30k_pairs(data_dir: str | None, n: int, seed: int) -> tuple[list[tuple[list[int], list[int]]], str]:
    """`n` random training pairs as token ids [BOS .. EOS] per side, and where their lengths come from."""
    rng = np.random.default_rng(seed)
    if data_dir and Path(data_dir).is_dir():
        from data.sources import load_multi30k
        from data.tokenization import train_bpe

        train = load_multi30k(data_dir, ["train"], "de", "en")["train"]
        sources, targets = train["src"][:], train["tgt"][:]
        tokenizer = train_bpe(sources + targets, VOCAB)
        pick = rng.choice(len(sources), size=n, replace=False).tolist()
        src_ids = tokenizer.encode_batch([sources[i] for i in pick])
        tgt_ids = tokenizer.encode_batch([targets[i] for i in pick])
        return list(zip(src_ids, tgt_ids)), f"Multi30k train de-en, joint BPE {tokenizer.vocab_size}"
    # stand-in: lengths like Multi30k's under BPE (mean ~15-16, long right tail), random ids
    lengths = np.clip(rng.gamma(6.0, 2.6, size=(n, 2)).round().astype(int) + 3, 5, 60)
    pairs = [
        (
            [1, *rng.integers(4, VOCAB, size=s - 2).tolist(), 2],
            [1, *rng.integers(4, VOCAB, size=t - 2).tolist(), 2],
        )
        for s, t in lengths
    ]
    return pairs, "synthetic Multi30k-like lengths (no MULTI30K_DIR): gamma(6, 2.6) + 3"


def e2e_schedules(
    pairs: list[tuple[list[int], list[int]]], max_tokens: int, batch_size: int, seed: int
) -> tuple[list[Batch], list[Batch]]:
    """The same sentences as bucketed token-budget batches (ours) and as random batches of `batch_size`."""
    from data.batching import TokenBudgetBatchSampler

    # the datamodule's length of a pair: max(source, target input) (data/batching.py)
    lengths = [max(len(s), len(t) - 1) for s, t in pairs]
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, shuffle=True, seed=seed)
    bucketed = [batch_from_ids([pairs[i] for i in indices]) for indices in sampler]
    order = np.random.default_rng(seed).permutation(len(pairs)).tolist()
    random_batches = [
        batch_from_ids([pairs[i] for i in order[start : start + batch_size]])
        for start in range(0, len(order), batch_size)
    ]
    return bucketed, random_batches
