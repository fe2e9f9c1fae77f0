"""Decoding A/B in CPU time: this checkout's greedy and beam-4 search vs our code at a git revision, the
same weights (d256 3+3, vocab 10k, 64 sentences x 40 tokens), one thread, rounds interleaved. CPU time
(`time.process_time`) instead of wall time, so that other jobs on a shared machine disturb it less.
Both must give the same tokens.

    python benchmarks/decode_ab.py REVISION [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from references import load_revision

from transformer.config import TransformerConfig
from transformer.decoding import beam_search, greedy_search
from transformer.model import Seq2SeqTransformer

SHAPE = {"d_model": 256, "n_heads": 4, "n_encoder_layers": 3, "n_decoder_layers": 3, "d_ff": 1024}


def _cpu_seconds(run: Callable[[], object]) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def main() -> None:
    revision, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
    torch.set_num_threads(1)
    old = load_revision(revision)
    values = {"src_vocab_size": 10_000, "dropout": 0.0, "max_len": 256, **SHAPE}
    torch.manual_seed(0)
    new_model = Seq2SeqTransformer(TransformerConfig(**values)).eval()  # type: ignore[arg-type]
    torch.manual_seed(0)
    old_model = old["model"].Seq2SeqTransformer(old["config"].TransformerConfig(**values)).eval()
    src = torch.randint(4, 10_000, (64, 24), generator=torch.Generator().manual_seed(1))
    src[:, 0], src[:, -1] = 1, 2
    limit = {"max_len_a": 0, "max_len_b": 40}
    cases = {
        "greedy": (
            lambda: greedy_search(new_model, src, **limit),
            lambda: old["decoding"].greedy_search(old_model, src, **limit),
        ),
        "beam4": (
            lambda: beam_search(new_model, src, beam_size=4, **limit)[0],
            lambda: old["decoding"].beam_search(old_model, src, beam_size=4, **limit)[0],
        ),
    }
    for name, (new, before) in cases.items():
        if not torch.equal(new(), before()):
            raise RuntimeError(f"{name}: this checkout and {revision} decode different tokens")
        times: dict[str, list[float]] = {"new": [], "old": []}
        for r in range(rounds):
            order = [("new", new), ("old", before)] if r % 2 == 0 else [("old", before), ("new", new)]
            for key, run in order:
                times[key].append(_cpu_seconds(run))
        ratios = [o / n for n, o in zip(times["new"], times["old"])]
        print(
            f"{name:7} this checkout {statistics.median(times['new']):.3f} s CPU, {revision} "
            f"{statistics.median(times['old']):.3f} s; {revision} / this (> 1: this faster): median "
            f"{statistics.median(ratios):.3f}, rounds {[round(x, 3) for x in ratios]}"
        )


if __name__ == "__main__":
    main()
