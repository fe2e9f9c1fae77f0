"""The model shapes and batches the benchmarks share: the paper's base model (WMT_BASE), a smoke-test
size (SMOKE), and WMT-like token batches bucketed by the project's sampler.

Lengths: synthetic, WMT14 en-de-like under a 32k BPE (no corpus download): source lengths log-normal with
median 24 subwords (mean ~28, a long right tail, clipped to [3, 250]), target = source x a log-normal ratio
(median 1.05, sigma 0.15), clipped likewise. Token ids are random. Batches: `TokenBudgetBatchSampler`
(shuffle=True, one pool: length-sorted, then the batches shuffled), its budget calibrated so that a batch
holds about `batch_tokens` non-pad source tokens and as many target tokens (the paper's "approximately
25000 source tokens and 25000 target tokens").
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import torch

from benchmarks.common.references import Batch, batch_from_lengths
from data.batching import TokenBudgetBatchSampler

WMT_BASE = {"d_model": 512, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6, "d_ff": 2048}
SMOKE = {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64}


def wmt_lengths(n: int, seed: int, max_len: int = 250) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) subword lengths of `n` WMT14-en-de-like sentence pairs (see the top)."""
    rng = np.random.default_rng(seed)
    src = np.exp(rng.normal(math.log(24), 0.55, n))
    tgt = src * np.exp(rng.normal(math.log(1.05), 0.15, n))
    return (
        np.clip(src.round(), 3, max_len).astype(np.int64),
        np.clip(tgt.round(), 3, max_len).astype(np.int64),
    )


def _sampler(src: np.ndarray, tgt: np.ndarray, max_tokens: int, seed: int) -> TokenBudgetBatchSampler:
    # the datamodule's length of a pair: max(source, target input = BOS + target); the target adds EOS
    return TokenBudgetBatchSampler(np.maximum(src, tgt + 1), max_tokens, shuffle=True, seed=seed)


def wmt_batches(
    n_batches: int, batch_tokens: int, vocab: int, seed: int = 0, max_len: int = 250
) -> list[Batch]:
    """`n_batches` batches of the sampler's epoch over WMT-like lengths, about `batch_tokens` non-pad
    tokens per side each (the budget is calibrated on the lengths: padding depends on the bucketing)."""
    per_batch = max(batch_tokens // 28, 1)  # sentences per batch at the mean length
    src, tgt = wmt_lengths(int(per_batch * n_batches * 1.3) + 64, seed, max_len)
    max_tokens = max(batch_tokens, max_len + 1)
    for _ in range(3):  # budget -> mean non-pad tokens per side -> rescaled budget
        batches = _sampler(src, tgt, max_tokens, seed).batches()
        per_side = statistics.mean((src[b].sum() + tgt[b].sum() + len(b)) / 2 for b in batches)
        max_tokens = max(int(max_tokens * batch_tokens / per_side), max_len + 1)
    batches = _sampler(src, tgt, max_tokens, seed).batches()
    generator = torch.Generator().manual_seed(seed)
    return [
        batch_from_lengths(torch.from_numpy(src[b]), torch.from_numpy(tgt[b]), vocab, generator)
        for b in list(batches)[:n_batches]
    ]
