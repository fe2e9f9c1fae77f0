"""Training-step throughput of Seq2SeqTransformer vs torch.nn.Transformer, and KV-cached greedy decoding.

Training: forward + label-smoothed cross entropy + backward + AdamW step on the same padded batches
(B pairs, lengths uniform in [10, 32], vocab 10k, tied embeddings, dropout 0.1). The reference is
torch.nn.Transformer between the same kind of embeddings (scaled, sinusoidal positions, dropout) and
tied output projection, given the same masks ours uses: source key padding + causal (a right-padded
target needs no padding mask of its own). Tokens/s counts non-pad source + target tokens; steps are
interleaved (alternating which model goes first) and medians reported.
Decoding: sentences/s of `greedy_search` (KV cache, finished sentences leave the batch) vs the same
greedy loop recomputing the decoder over the whole prefix at each step; both must agree token for token.
Prints a table, then one JSON line of ratios (> 1 means ours / the cache is faster).
The fuller comparison (Marian too, MFU, profiles, memory, end to end) is bench_train.py / bench_decode.py;
the reference models and batches live in references.py.

    python benchmarks/bench_model.py [--cases d256,d512] [--steps 3] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import recompute_greedy
from references import PAD, Batch, TorchReference, make_batches

from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer
from transformer.search.decoding import beam_search, greedy_search

CASES = {
    "d256": {"d_model": 256, "n_heads": 4, "n_encoder_layers": 3, "n_decoder_layers": 3, "d_ff": 1024},
    "d512": {"d_model": 512, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6, "d_ff": 2048},
}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> float:
    start = time.perf_counter()
    logits = model(batch.src, batch.tgt_in)  # (B, T, V)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), batch.tgt_out.reshape(-1), ignore_index=PAD, label_smoothing=0.1
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def bench_training(config: TransformerConfig, batches: list[Batch], warmup: int) -> dict[str, float]:
    """Median tokens/s of ours and torch's, steps interleaved on the same batches."""
    torch.manual_seed(0)
    models = {"ours": Seq2SeqTransformer(config), "torch": TorchReference(config)}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    rates: dict[str, list[float]] = {name: [] for name in models}
    for i, batch in enumerate(batches):
        order = list(models) if i % 2 == 0 else list(reversed(models))
        for name in order:
            seconds = train_step(models[name], optimizers[name], batch)
            if i >= warmup:
                rates[name].append(batch.n_tokens / seconds)
    return {name: statistics.median(values) for name, values in rates.items()}


def _time(fn: Callable[[], Tensor], repeats: int) -> tuple[float, Tensor]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    assert out is not None
    return statistics.median(times), out


def bench_decoding(config: TransformerConfig, batch_size: int, length: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = Seq2SeqTransformer(config).eval()
    generator = torch.Generator().manual_seed(1)
    src = make_batches(1, batch_size, config.src_vocab_size, generator)[0].src
    cached_s, cached = _time(lambda: greedy_search(model, src, max_len_a=0, max_len_b=length), repeats)
    recompute_s, recomputed = _time(lambda: recompute_greedy(model, src, length), repeats)
    if not torch.equal(cached, recomputed[:, : cached.size(1)]):
        raise RuntimeError("KV-cached greedy search and recomputation disagree")
    beam_s, _ = _time(lambda: beam_search(model, src, beam_size=4, max_len_a=0, max_len_b=length)[0], 1)
    return {
        "greedy_cached": batch_size / cached_s,
        "greedy_recompute": batch_size / recompute_s,
        "beam4_cached": batch_size / beam_s,
        "mean_length": float(cached.ne(PAD).sum(1).float().mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="d256,d512", help="comma-separated subset of " + ",".join(CASES))
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per model")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-length", type=int, default=40)
    parser.add_argument("--decode-repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny batches: checks that the script runs")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.batch_size, args.decode_batch, args.decode_length, args.steps = 8, 8, 8, 1

    ratios: dict[str, float] = {}
    rows = []
    for name in args.cases.split(","):
        config = TransformerConfig(src_vocab_size=10_000, max_len=128, **CASES[name])  # type: ignore[arg-type]
        batches = make_batches(
            args.warmup + args.steps, args.batch_size, 10_000, torch.Generator().manual_seed(0)
        )
        train = bench_training(config, batches, args.warmup)
        decode = bench_decoding(config, args.decode_batch, args.decode_length, args.decode_repeats)
        rows.append((name, train, decode))
        ratios[f"{name}_train_ours_vs_torch"] = train["ours"] / train["torch"]
        ratios[f"{name}_greedy_cached_vs_recompute"] = decode["greedy_cached"] / decode["greedy_recompute"]

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch_size} pairs")
    print(f"{'case':6} {'train ours tok/s':>17} {'torch tok/s':>12} {'ratio':>6} | {'greedy cached':>13} "
          f"{'recompute':>10} {'ratio':>6} {'beam4 cached':>13}  (sentences/s, mean length)")  # fmt: skip
    for name, train, decode in rows:
        print(
            f"{name:6} {train['ours']:17.0f} {train['torch']:12.0f} {train['ours'] / train['torch']:6.2f} | "
            f"{decode['greedy_cached']:13.1f} {decode['greedy_recompute']:10.1f} "
            f"{decode['greedy_cached'] / decode['greedy_recompute']:6.2f} {decode['beam4_cached']:13.1f}  "
            f"({decode['mean_length']:.1f})"
        )
    print(json.dumps({key: round(value, 3) for key, value in ratios.items()}))


if __name__ == "__main__":
    main()
