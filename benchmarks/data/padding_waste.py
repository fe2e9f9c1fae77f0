"""Padding waste of token-budget length bucketing vs plain random batching on real Multi30k.

For each strategy and token budget it builds the batches of a few epochs of the training split and
reports the share of pad tokens in the padded `src` and `tgt_in` tensors, the batches per epoch and the
largest padded batch. Prints a Markdown table, then one JSON line.

    python -m benchmarks.data.padding_waste --data-dir ../shared/data/multi30k
    python -m benchmarks.data.padding_waste --smoke   # 2k pairs, BPE 500, one budget, one epoch
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterable

import numpy as np

from data.batching import TokenBudgetBatchSampler
from data.sources import load_multi30k
from data.tokenization import train_bpe


def _stats(batches: Iterable[list[int]], src_len: np.ndarray, tgt_len: np.ndarray) -> dict[str, float]:
    real = padded = largest = count = 0
    for batch in batches:
        index = np.asarray(batch)
        s, t = src_len[index], tgt_len[index]
        cells = len(index) * (s.max() + t.max())  # padded src (B, S) + padded tgt_in (B, T)
        real += int(s.sum() + t.sum())
        padded += int(cells)
        largest = max(largest, int(len(index) * max(s.max(), t.max())))
        count += 1
    return {"pad_pct": 100 * (1 - real / padded), "batches": count, "largest_batch_tokens": largest}


def _random_fixed_size(n: int, batch_size: int, seed: int) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(n)
    return [order[i : i + batch_size].tolist() for i in range(0, n, batch_size)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR"), help="Multi30k data/task1/raw")
    parser.add_argument("--src-lang", default="de")
    parser.add_argument("--tgt-lang", default="en")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help="the first 2k pairs, BPE 500, 1024 tokens, 1 epoch"
    )
    args = parser.parse_args(argv)
    if not args.data_dir:
        parser.error("--data-dir (or MULTI30K_DIR) is required")

    start = time.perf_counter()
    train = load_multi30k(args.data_dir, ["train"], args.src_lang, args.tgt_lang)["train"]
    sources, targets = train["src"][:], train["tgt"][:]
    if args.smoke:
        sources, targets = sources[:2000], targets[:2000]
        args.vocab_size, args.max_tokens, args.epochs = 500, [1024], 1
    tokenizer = train_bpe(sources + targets, args.vocab_size)
    src_len = np.array([len(ids) for ids in tokenizer.encode_batch(sources)])  # BOS .. EOS
    tgt_len = np.array([len(ids) - 1 for ids in tokenizer.encode_batch(targets)])  # tgt_in = BOS y1..yn
    lengths = np.maximum(src_len, tgt_len)

    rows = []
    for max_tokens in args.max_tokens:
        strategies = {
            "bucketed, one pool (default)": {"pool_size": None},
            "bucketed, pools of 10k": {"pool_size": 10_000},
            "bucketed, pools of 1k": {"pool_size": 1_000},
            "random order, token budget": {"pool_size": 1},  # pools of one example: no sorting
        }
        for name, kwargs in strategies.items():
            sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=args.seed, **kwargs)
            epochs = []
            for epoch in range(args.epochs):
                sampler.set_epoch(epoch)
                epochs.append(_stats(sampler, src_len, tgt_len))
            rows.append({"strategy": name, "max_tokens": max_tokens, **_mean(epochs)})
        # Plain random batching with a fixed number of sentences: as many batches as the default bucketing.
        batch_size = round(len(lengths) / rows[-4]["batches"])
        epochs = [
            _stats(_random_fixed_size(len(lengths), batch_size, args.seed + e), src_len, tgt_len)
            for e in range(args.epochs)
        ]
        rows.append(
            {"strategy": f"random, {batch_size} sentences", "max_tokens": max_tokens, **_mean(epochs)}
        )

    print(
        f"Multi30k train {args.src_lang}->{args.tgt_lang}: {len(lengths)} pairs, BPE {tokenizer.vocab_size}, "
        f"mean src/tgt_in {src_len.mean():.1f}/{tgt_len.mean():.1f} tokens, mean of {args.epochs} epochs"
    )
    print("\n| max_tokens | strategy | pad % | batches/epoch | largest padded batch (tokens) |")
    print("|---:|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['max_tokens']} | {row['strategy']} | {row['pad_pct']:.1f} | {row['batches']:.0f} "
            f"| {row['largest_batch_tokens']:.0f} |"
        )
    result = {"benchmark": "padding_waste", "dataset": "multi30k", "pairs": len(lengths), "rows": rows}
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))


def _mean(epochs: list[dict[str, float]]) -> dict[str, float]:
    return {key: float(np.mean([e[key] for e in epochs])) for key in epochs[0]}


if __name__ == "__main__":
    main()
