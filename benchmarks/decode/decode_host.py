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
3. `--cpu-time` instead: the host's share of eager decoding in CPU time (`time.process_time`, less
   disturbed by other jobs on a shared machine), one thread: the WMT-base depth (6 + 6 layers, 8 heads)
   at a width of 64 and 4 sentences a batch, 2 batches of 32 tokens (as bench_gpu decodes); ours against
   transformers `generate` and, with `--baseline REVISION`, against our code there too (both must decode
   the same tokens). `--cuda-path` runs our attention's CUDA code on the CPU (the SDPA backends without
   cuDNN's, `kernels._WITHOUT_CUDNN_DEVICES`, in both checkouts): the host work a GPU's step pays.

    python -m benchmarks.decode.decode_host [--results-dir benchmarks/results/decode]
    python -m benchmarks.decode.decode_host --cpu-time [--baseline REVISION] [--rounds 5] [--cuda-path]
    python -m benchmarks.decode.decode_host --smoke [--cpu-time]   # tiny shapes, one round, in seconds

Prints two tables and one JSON line (`--cpu-time`: one line per search and competitor).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.machine import cpu_name
from benchmarks.common.references import load_revision, marian_generate
from benchmarks.common.shapes import SMOKE, WMT_BASE
from benchmarks.common.timing import interleaved, paired_cpu_seconds, paired_ratio
from benchmarks.gpu.decoding import MODES, decode_methods, decode_models, source_batches, step_backend
from transformer.config import TransformerConfig
from transformer.search.decoding import DecodingSettings, search

# --cpu-time: the WMT-base depth, so many operators a step; so narrow that they cost their dispatch only
HOST_SHAPE = {"d_model": 64, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6, "d_ff": 64}
HOST_LENGTH = 32  # target tokens per sentence (EOS forced there, as bench_gpu decodes)
HOST_BATCH = 4  # sentences a batch, 2 batches: few enough that each kernel costs about its dispatch


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
    shape = SMOKE if args.smoke else WMT_BASE
    config = TransformerConfig(
        src_vocab_size=1000, tgt_vocab_size=1000, max_len=256, tie_embeddings="all", **shape
    )
    ours, _ = decode_models(config, torch.device("cpu"), torch.float32)
    src = source_batches(1, 8, config.src_vocab_size)[0]
    rows = []
    # --smoke: greedy and Dynamo's tracing only (each backend's first call costs seconds even when tiny)
    for beams in (1,) if args.smoke else (1, 4):
        for backend in ("static", "eager") if args.smoke else ("static", "eager", "aot_eager"):
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


def _generate(
    marian: Any, batches: list[torch.Tensor], beams: int, length: int
) -> Callable[[], list[torch.Tensor]]:
    return lambda: [marian_generate(marian, src, length, beams) for src in batches]


def cpu_time(revision: str | None, rounds: int, cuda_path: bool, smoke: bool) -> None:
    """--cpu-time: ours against generate (and our code at `revision`) in CPU time, one line each."""
    import transformer.search.decoding as decoding
    from transformer import kernels

    shape, batch, length = (SMOKE, 2, 4) if smoke else (HOST_SHAPE, HOST_BATCH, HOST_LENGTH)
    values = {"src_vocab_size": 1_000, "dropout": 0.0, "max_len": 256, **shape}
    ours, marian = decode_models(TransformerConfig(**values), torch.device("cpu"), torch.float32)
    batches = source_batches(2, batch, values["src_vocab_size"])
    steps = len(batches) * length
    old: dict[str, Any] = {}
    if revision is not None:
        old = load_revision(revision)
        old_model = old["model"].Seq2SeqTransformer(old["config"].TransformerConfig(**values)).eval()
        old_model.load_state_dict(ours.state_dict())
    if cuda_path:
        for module in (kernels, old.get("kernels")):
            if module is not None:
                module._WITHOUT_CUDNN_DEVICES = frozenset({"cpu"})

    def runner(model: Any, module: Any, beams: int) -> Callable[[], list[torch.Tensor]]:
        limit = {"max_len_a": 0, "max_len_b": length}
        if beams == 1:
            return lambda: [module.greedy_search(model, src, **limit) for src in batches]
        return lambda: [module.beam_search(model, src, beam_size=beams, **limit)[0] for src in batches]

    for name, beams in (("greedy", 1), ("beam4", 4)):
        run_ours = runner(ours, decoding, beams)
        competitors = {"transformers generate": _generate(marian, batches, beams, length)}
        if old:
            run_old = runner(old_model, old["decoding"], beams)
            if not all(torch.equal(a, b) for a, b in zip(run_ours(), run_old())):
                raise RuntimeError(f"{name}: this checkout and {revision} decode different tokens")
            competitors[f"ours at {revision}"] = run_old
        for label, other in competitors.items():
            now, then, ratios = paired_cpu_seconds(run_ours, other, rounds)
            print(
                f"host {name:6} ours {now / steps * 1e3:.2f} ms/step, {label} {then / steps * 1e3:.2f} "
                f"ms/step CPU; {label} / ours (> 1: ours faster): median {statistics.median(ratios):.3f}, "
                f"rounds {[round(x, 3) for x in ratios]}"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results-dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one round: checks the code path")
    parser.add_argument("--cpu-time", action="store_true", help="instead: the host's share in CPU time")
    parser.add_argument("--baseline", default=None, help="with --cpu-time: a git revision to compare with")
    parser.add_argument("--rounds", type=int, default=5, help="with --cpu-time: interleaved rounds")
    parser.add_argument("--cuda-path", action="store_true", help="with --cpu-time: our attention's CUDA code")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cpu_time:
        cpu_time(args.baseline, 1 if args.smoke else args.rounds, args.cuda_path, args.smoke)
        return
    if args.smoke:
        args.batch, args.length, args.repeats = 2, 4, 1
    model_name = cpu_name()
    lines = [
        f"# python -m benchmarks.decode.decode_host on {model_name}, {args.threads} thread(s), "
        f"torch {torch.__version__}"
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
