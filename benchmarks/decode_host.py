"""The host's part of a decoding step, measured on the CPU: what an eager GPU step waits for.

1. Per step, ours vs transformers `generate` on a model so narrow (d_model 16, 6+6 layers) that the
   arithmetic is next to nothing: what is left is each library's Python and dispatch per step, which is
   what sets an eager step's speed on a GPU too (its kernels are a few microseconds each). Same fixed
   work as bench_gpu.py's decoding (every sentence exactly `--length` tokens), interleaved rounds,
   paired ratios.
2. The first call of `decode.kv_cache=compiled` at the WMT-base shape with torch.compile's cheap
   backends: "eager" (Dynamo's tracing alone) and "aot_eager" (Dynamo and AOTAutograd: what the
   "cudagraphs" backend runs before it records), against an eager static search of the same batch.
   That is the first-call cost those backends add on a GPU beyond recording, on this host's CPU.

    python benchmarks/decode_host.py [--results-dir benchmarks/results]

Prints two tables and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# from a plain copy (nothing installed): the repository for `transformer`, this folder for its parts
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_data import cpu_name
from bench_gpu import WMT_BASE
from decode_timing import interleaved, paired_ratio
from gpu_decode import MODES, decode_methods, decode_models, source_batches, step_backend

from transformer.config import TransformerConfig
from transformer.search.decoding import DecodingSettings, search


def host_per_step(args: argparse.Namespace) -> list[dict[str, Any]]:
    """ms per step of ours and generate, greedy and beam 4, at a width where compute is negligible."""
    config = TransformerConfig(
        src_vocab_size=64, tgt_vocab_size=64, d_model=16, n_heads=2, d_ff=32,
        n_encoder_layers=6, n_decoder_layers=6, max_len=256, tie_embeddings="all",
    )  # fmt: skip
    ours, marian = decode_models(config, torch.device("cpu"), torch.float32)
    batches = source_batches(1, args.batch, config.src_vocab_size)
    rows = []
    for mode in ("greedy", "beam4"):
        methods = decode_methods(
            ours, marian, None, batches, MODES[mode], args.length
        )  # bench_gpu's, on the CPU
        for method in methods.values():
            method()  # warm-up
        times, _ = interleaved(methods, args.repeats)
        row: dict[str, Any] = {"search": mode}
        for name, seconds in times.items():
            row[f"{name} ms/step"] = 1e3 * statistics.median(seconds) / args.length
        row["ours x generate"] = paired_ratio(times, "ours", "transformers generate")
        rows.append(row)
    return rows


def first_calls(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Seconds of a search's first and second call: eager static cache, then the compiled step with each
    cheap backend (each in a fresh Dynamo state)."""
    config = TransformerConfig(
        src_vocab_size=1000, tgt_vocab_size=1000, max_len=256, tie_embeddings="all", **WMT_BASE
    )
    ours, _ = decode_models(config, torch.device("cpu"), torch.float32)
    src = source_batches(1, 8, config.src_vocab_size)[0]
    rows = []
    for beams in (1, 4):
        for backend in ("static", "eager", "aot_eager"):
            settings = DecodingSettings(
                beam_size=beams,
                max_len_a=0,
                max_len_b=8,
                kv_cache="static" if backend == "static" else "compiled",
            )
            torch._dynamo.reset()
            seconds = []
            with contextlib.nullcontext() if backend == "static" else step_backend(backend):
                for _ in range(2):
                    start = time.perf_counter()
                    search(ours, src, settings)
                    seconds.append(time.perf_counter() - start)
            search_name = "greedy" if beams == 1 else "beam4"
            rows.append(
                {"search": search_name, "step": backend, "first s": seconds[0], "second s": seconds[1]}
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results-dir", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_name = cpu_name()
    lines = [
        f"# benchmarks/decode_host.py on {model_name}, {args.threads} thread(s), torch {torch.__version__}"
    ]

    host = host_per_step(args)
    lines.append(f"\nHost per step (d_model 16, 6+6 layers, batch {args.batch}, {args.length} tokens, "
                 f"median of {args.repeats} interleaved rounds)")  # fmt: skip
    lines.append(f"{'search':8} {'ours ms/step':>13} {'generate ms/step':>17} {'ours x generate':>16}")
    for row in host:
        lines.append(
            f"{row['search']:8} {row['ours ms/step']:13.3f} {row['transformers generate ms/step']:17.3f} "
            f"{row['ours x generate']:16.2f}"
        )
    first = first_calls(args)
    lines.append(
        "\nFirst call of a search at WMT-base (batch 8, 8 tokens, fp32): the step eager over the static"
        " cache, or compiled with a cheap backend"
    )
    lines.append(f"{'search':8} {'step':10} {'first s':>8} {'second s':>9}")
    for row in first:
        lines.append(f"{row['search']:8} {row['step']:10} {row['first s']:8.2f} {row['second s']:9.2f}")
    record = {
        "benchmark": "decode_host", "date": str(datetime.date.today()), "cpu": model_name,
        "threads": args.threads, "torch": torch.__version__, "host_per_step": host, "first_calls": first,
    }  # fmt: skip
    text = "\n".join(lines) + "\n\n" + json.dumps(record, default=float) + "\n"
    print(text, end="")
    if args.results_dir:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        out = args.results_dir / f"{record['date']}_cpu_decode_host.txt"
        out.write_text(text)
        print(f"written: {out}")


if __name__ == "__main__":
    main()
