"""Activation checkpointing: memory and time of one training step (forward, label-smoothed loss, backward)
with and without `model.activation_checkpointing`, each in a fresh process.

Model d512, 6+6 layers, 8 heads, d_ff 2048, vocab 10k, tied embeddings, dropout 0.1; a batch of 8,192
non-pad tokens (128 pairs of 32 source + 32 target tokens). Per variant: the peak resident memory the
step adds (`ru_maxrss` after the step minus the resident size before it: activations, gradients and the
allocator's slack), autograd's saved tensors of the forward (bytes kept for the backward pass, counted
with saved_tensors_hooks in a separate forward), and the step's seconds (median of --repeats).

    python -m benchmarks.train.bench_checkpointing [--repeats 3] [--threads 2] [--quick | --smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rss_kib() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def measure(checkpointing: bool, repeats: int, threads: int, quick: bool) -> dict[str, float]:
    """One variant, in this process: saved bytes, the step's peak memory and seconds."""
    import torch

    from transformer.config import TransformerConfig
    from transformer.losses import label_smoothed_cross_entropy
    from transformer.model import Seq2SeqTransformer
    from transformer.stacks import checkpoint_layers

    torch.set_num_threads(threads)
    shape = {"d_model": 64, "n_heads": 4, "d_ff": 128, "n_encoder_layers": 2, "n_decoder_layers": 2}
    if not quick:
        shape = {"d_model": 512, "n_heads": 8, "d_ff": 2048, "n_encoder_layers": 6, "n_decoder_layers": 6}
    config = TransformerConfig(src_vocab_size=10_000, max_len=64, tie_embeddings="all", **shape)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = Seq2SeqTransformer(config).train()
    checkpoint_layers(model, checkpointing)
    pairs = 8 if quick else 128
    src = torch.randint(4, 10_000, (pairs, 32))
    tgt = torch.randint(4, 10_000, (pairs, 33))

    def step() -> None:
        model.zero_grad(set_to_none=False)
        logits = model(src, tgt[:, :-1])
        out = label_smoothed_cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), label_smoothing=0.1)
        out.loss.backward()

    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(src, tgt[:, :-1])
    saved_bytes = sum(size for pointer, size in saved.items() if pointer not in parameters)
    for p in model.parameters():  # gradients allocated before the baseline: the step's own memory only
        p.grad = torch.zeros_like(p)
    before = _rss_kib()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "saved_mb": saved_bytes / 2**20,
        "step_peak_mb": (peak - before) / 1024,
        "step_s": statistics.median(seconds),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quick", "--smoke", action="store_true", help="a tiny model: checks that the script works"
    )
    parser.add_argument("--variant", choices=["plain", "checkpointed"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:  # a child process: one variant, one JSON line
        print(json.dumps(measure(args.variant == "checkpointed", args.repeats, args.threads, args.quick)))
        return
    rows = {}
    for variant in ("plain", "checkpointed"):
        command = [
            sys.executable,
            "-m",
            "benchmarks.train.bench_checkpointing",
            "--variant",
            variant,
            "--repeats",
            str(args.repeats),
        ]
        command += ["--threads", str(args.threads)] + (["--quick"] if args.quick else [])
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(command, capture_output=True, text=True, check=True, env=env, cwd=ROOT)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    shape = "d64 2+2, 512 tokens" if args.quick else "d512 6+6, 8192 tokens"
    print(
        f"activation checkpointing, one training step, {shape}, {args.threads} threads, {os.cpu_count()} CPUs"
    )
    print(f"{'variant':14} {'saved for backward MB':>22} {'step peak MB':>13} {'step s':>8}")
    for variant, row in rows.items():
        print(f"{variant:14} {row['saved_mb']:22.1f} {row['step_peak_mb']:13.1f} {row['step_s']:8.2f}")
    ratios = {
        "saved": rows["checkpointed"]["saved_mb"] / rows["plain"]["saved_mb"],
        "step_peak": rows["checkpointed"]["step_peak_mb"] / rows["plain"]["step_peak_mb"],
        "step_time": rows["checkpointed"]["step_s"] / rows["plain"]["step_s"],
    }
    print("checkpointed / plain: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print(json.dumps({"benchmark": "bench_checkpointing", "shape": shape, **rows, "ratios": ratios}))


if __name__ == "__main__":
    main()
