"""One-call GPU benchmark: training and decoding at the WMT-base shape, ours against the references.

Training (gpu_train.py): the paper's base model (d_model 512, 6+6 layers, 8 heads, d_ff 2048, one shared
32k vocabulary, tied embeddings, dropout 0.1), bf16 autocast, fused AdamW, label-smoothed cross entropy,
token batches of about 25k non-pad source and 25k target tokens with WMT-like lengths, bucketed by the
project's TokenBudgetBatchSampler. Competitors, one after another on the same batches: ours eager, ours
compiled, torch.nn.Transformer eager and compiled, transformers' MarianMTModel; built as bench_train.py
builds them (train_runners.py). Reported: non-pad tokens/s, MFU (gpu_train.FLOPS_FORMULA over the dense
bf16 peak of the GPU's data sheet), peak memory (torch.cuda.max_memory_allocated), compile seconds (the
warm-up steps' time beyond what they take compiled) and recompilations. A case that fails (or compiles
longer than --compile-timeout) is reported in the table, and the others still run.

Decoding (gpu_decode.py): beam 4 and greedy, batches of 64 and 256 sentences, bf16: ours vs transformers
`generate` (and CTranslate2 when a CUDA build of it is importable), sentences/s and tokens/s; on CUDA also
"ours compiled step" (`decode.kv_cache=compiled`: static KV cache, the decoder step as a CUDA graph).

    python benchmarks/bench_gpu.py                  # on one GPU, a few minutes
    python benchmarks/bench_gpu.py --smoke          # the same code on the CPU in seconds (tiny, fp32)

Prints the tables and one JSON line, and writes both to benchmarks/results/<date>_<gpu>_bench_gpu.txt
(--results-dir; --smoke writes only where --results-dir says).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning under load

import argparse
import contextlib
import datetime
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import GPU_BF16_PEAK_TFLOPS
from gpu_decode import run_decoding
from gpu_train import FLOPS_FORMULA, run_training_case, wmt_batches

from transformer.config import TransformerConfig

WMT_BASE = {"d_model": 512, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6, "d_ff": 2048}
SMOKE = {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64}
TRAINING = ("ours", "ours:compiled", "torch", "torch:compiled", "marian")
RESULTS = Path(__file__).resolve().parent / "results"
# issue 29's targets on one H100
TARGETS = {"mfu_pct": 25.0, "train_vs_torch_eager": 1.5, "compile_s": 90.0, "beam4": 1.5, "greedy": 2.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, fp32, on the CPU, in seconds")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    parser.add_argument("--models", default=",".join(TRAINING), help="training competitors to run")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--batch-tokens", type=int, default=25_000, help="non-pad tokens per side")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per model")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (compiling)")
    parser.add_argument("--compile-timeout", type=int, default=150, help="seconds for a model's warm-up")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--decode-batch-sizes", default="64,256")
    parser.add_argument("--decode-batches", type=int, default=2, help="batches per decoding run")
    parser.add_argument("--decode-length", type=int, default=32, help="target tokens per sentence")
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--skip", default="", help="train and/or decode")
    parser.add_argument(
        "--results-dir", default=None, help=f"where the output is written (default {RESULTS})"
    )
    args = parser.parse_args(argv)
    if args.smoke:  # the same code path at toy sizes; compiled by Dynamo only (backend eager)
        args.device = args.device or "cpu"
        args.vocab, args.batch_tokens, args.steps, args.warmup = 1000, 300, 2, 1
        args.decode_batch_sizes, args.decode_batches, args.decode_length = "4,8", 1, 5
        args.decode_repeats, args.compile_backend = 1, "eager"
    args.device = args.device or "cuda"
    args.decode_batch_sizes = [int(size) for size in args.decode_batch_sizes.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False here); --smoke runs on the CPU")
    args.bf16 = args.device == "cuda"
    if args.results_dir is None and not args.smoke:
        args.results_dir = str(RESULTS)
    return args


def describe(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The GPU (or CPU), its bf16 peak from the data-sheet table, versions; printed and returned."""
    import transformers

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((tflops for key, tflops in GPU_BF16_PEAK_TFLOPS.items() if key in name), None)
    args.peak_tflops = peak if device.type == "cuda" else None
    info = {
        "benchmark": "bench_gpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "device": name,
        "bf16_peak_tflops": args.peak_tflops,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "dtype": "bf16 autocast (training), bf16 weights (decoding)" if args.bf16 else "fp32",
        "smoke": args.smoke,
    }
    print(", ".join(f"{k} {v}" for k, v in info.items() if k != "benchmark"))
    if device.type == "cuda" and peak is None:
        print(f"no data-sheet bf16 peak for {name!r} in bench_train.GPU_BF16_PEAK_TFLOPS: MFU not reported")
    return info


def training(args: argparse.Namespace, config: TransformerConfig, device: torch.device) -> dict[str, Any]:
    batches = [b.to(device) for b in wmt_batches(args.warmup + args.steps, args.batch_tokens, args.vocab)]
    rows = {name: run_training_case(name, config, batches, args, device) for name in args.models.split(",")}
    timed = batches[args.warmup :]
    print(
        f"\nTraining, {len(timed)} timed steps after {args.warmup} warm-up, batches of "
        f"{sum(b.n_tokens for b in timed) / len(timed):.0f} non-pad tokens (source + target), "
        f"{sum(b.src.size(0) for b in timed) / len(timed):.0f} pairs, "
        f"{100 * sum(b.pad_fraction for b in timed) / len(timed):.1f}% padding"
    )
    print(f"MFU FLOPs: {FLOPS_FORMULA}")
    print(f"{'model':16} {'tok/s':>10} {'MFU %':>6} {'TFLOP/s':>8} {'step s':>7} {'peak GB':>8} ", end="")
    print(f"{'compile s':>9} {'frames':>6}")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:16} failed: {row['error']}")
            continue
        mfu = f"{row['mfu_pct']:6.1f}" if row.get("mfu_pct") is not None else f"{'-':>6}"
        mem = f"{row['peak_mem_gb']:8.1f}" if "peak_mem_gb" in row else f"{'-':>8}"
        comp = (
            f"{row['compile_s']:9.1f} {row['frames_compiled']:6d}"
            if "compile_s" in row
            else f"{'-':>9} {'-':>6}"
        )
        print(f"{name:16} {row['tok_s']:10.0f} {mfu} {row['tflops']:8.2f} {row['step_s']:7.3f} {mem} {comp}")
    print("(frames: what Dynamo compiled, 1 = one graph; every graph break and recompilation adds one)")
    return rows


def decoding(args: argparse.Namespace, config: TransformerConfig, device: torch.device) -> dict[str, Any]:
    rows = run_decoding(config, args, device)
    print(
        f"\nDecoding, {args.decode_batches} batches of each size, every sentence {args.decode_length} "
        f"tokens, median of {args.decode_repeats} interleaved rounds; CTranslate2: {rows['ctranslate2']}"
    )
    print(f"{'case':14} {'method':22} {'sent/s':>9} {'tok/s':>10} {'mean len':>8} {'ours x':>7}")
    for case, methods in rows.items():
        if case == "ctranslate2":
            continue
        for name, row in methods.items():
            if "error" in row:
                print(f"{case:14} {name:22} failed: {row['error']}")
                continue
            speedup = f"{row['ours_speedup']:7.2f}" if "ours_speedup" in row else f"{'':>7}"
            cells = f"{row['sent_s']:9.1f} {row['tok_s']:10.0f} {row['mean_length']:8.1f}"
            print(f"{case:14} {name:22} {cells} {speedup}")
    return rows


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """The figures issue 29 sets targets for, where measured."""
    train, out = result.get("train", {}), {}
    torch_eager = train.get("torch", {}).get("tok_s")
    for name in ("ours", "ours:compiled"):
        row = train.get(name, {})
        if "tok_s" in row and torch_eager:
            out[f"train_{name.replace(':', '_')}_vs_torch_eager"] = row["tok_s"] / torch_eager
    for case, methods in result.get("decode", {}).items():
        if isinstance(methods, dict):
            for name, row in methods.items():
                if "ours_speedup" in row:
                    out[f"decode_{case}_ours_vs_{name.replace(' ', '_')}"] = row["ours_speedup"]
    return out


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    result = describe(args, device)
    config = TransformerConfig(src_vocab_size=args.vocab, max_len=256, **(SMOKE if args.smoke else WMT_BASE))
    skip = set(args.skip.split(","))
    if "train" not in skip:
        result["train"] = training(args, config, device)
    if "decode" not in skip:
        result["decode"] = decoding(args, config, device)
    result["ratios"] = ratios(result)
    result["targets"] = TARGETS
    print("\n" + ", ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items()))
    print(json.dumps(_rounded(result)))
    return result


def results_path(directory: str, info: dict[str, Any]) -> Path:
    """<dir>/<date>_<gpu>_bench_gpu.txt, the GPU as a short name (h100, h200, a100, ...; smoke: cpu_smoke)."""
    known = re.search(r"(H100|H200|A100|A10G|L40S|L4|V100|B200)", info["device"])
    gpu = (
        "cpu_smoke"
        if info["smoke"]
        else known.group(1).lower()
        if known
        else re.sub(r"\W+", "_", info["device"])
    )
    path = Path(directory) / f"{info['date']}_{gpu}_bench_gpu.txt"
    for n in range(2, 100):  # a second run the same day does not overwrite the first
        if not path.exists():
            break
        path = path.with_name(f"{info['date']}_{gpu}_bench_gpu_{n}.txt")
    return path


class _Tee(io.TextIOBase):
    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
            stream.flush()
        return len(text)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    captured = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, captured)):
        result = run(args)
    if args.results_dir:
        path = results_path(args.results_dir, result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"$ python benchmarks/bench_gpu.py {' '.join(argv or sys.argv[1:])}\n{captured.getvalue()}"
        )
        print(f"written to {path}")


if __name__ == "__main__":
    main()
