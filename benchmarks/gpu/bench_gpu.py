"""One-call GPU benchmark: training and decoding at the WMT-base shape, ours against the references.

Training (training.py here): the paper's base model (d_model 512, 6+6 layers, 8 heads, d_ff 2048, one shared
32k vocabulary, tied embeddings, dropout 0.1), bf16 autocast, fused AdamW, label-smoothed cross entropy,
token batches of about 25k non-pad source and 25k target tokens with WMT-like lengths, bucketed by the
project's TokenBudgetBatchSampler. Competitors, one after another on the same batches: ours eager, ours
compiled (the step, `model.compile=true`, and its layers only, `model.compile=layers`), torch.nn.Transformer
eager and compiled, transformers' MarianMTModel; built as bench_train builds them (train/runners.py).
Reported: non-pad tokens/s, MFU (training.FLOPS_FORMULA over the dense bf16 peak of the GPU's data
sheet), peak memory (torch.cuda.max_memory_allocated), compile seconds (the warm-up steps' time beyond
what they take compiled) and recompilations. A case that fails (or compiles
longer than --compile-timeout) is reported in the table, and the others still run.

Decoding (decoding.py here): beam 4 and greedy, batches of 64 and 256 sentences, bf16: ours vs transformers
`generate` (and CTranslate2 when a CUDA build of it is importable), sentences/s and tokens/s; on CUDA also
"ours compiled step" (`decode.kv_cache=compiled`: static KV cache, the decoder step as a CUDA graph) and
"ours cudagraphs step" (the same with torch.compile's "cudagraphs" backend: the eager step's kernels
recorded, no Inductor code generation) and "ours graphed step" (the eager step recorded with
torch.cuda.CUDAGraph, no compiler: `transformer.search.graphed`). Is a first call much cheaper, and how
much speed does each keep?

    python -m benchmarks.gpu.bench_gpu            # on one GPU, at most --budget-s (480) seconds
    python -m benchmarks.gpu.bench_gpu --smoke    # the same code on the CPU in seconds (tiny, fp32)

Runs from the root of a plain copy of the repository (nothing installed; needs torch, numpy and
transformers, nothing else of the project's dependencies: a bare GPU box). The cases run in
the order of what they are worth (VALUE_ORDER: our training step and its reference first), each in a
time box; once --budget-s is spent the rest are reported as skipped. Each finished case's row is
appended to benchmarks/results/gpu/<date>_<gpu>_bench_gpu.txt as it finishes (--results-dir; --smoke writes
only where --results-dir says), so a run cut off by a time limit leaves what it measured; the summary, the
targets met or not (targets.py here) and one JSON line come last.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning under load

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.machine import gpu_bf16_peak_tflops
from benchmarks.common.results import RESULTS_DIR, logged_stdout
from benchmarks.common.shapes import SMOKE, WMT_BASE, wmt_batches
from benchmarks.gpu.decoding import METHOD_KEYS, MODES, DecodingBench
from benchmarks.gpu.targets import TARGETS, print_targets, ratios, target_checks
from benchmarks.gpu.training import FLOPS_FORMULA, run_training_case, time_limit
from transformer.config import TransformerConfig

TRAINING = (
    "ours", "ours:compiled", "ours:compiled-layers", "torch", "torch:no-cudnn", "torch:compiled", "marian",
)  # fmt: skip
# What each case is worth, most first: our step and the reference its target is set against, decoding at
# the first batch size, then the compiled step and layers (compile time is a target), then the rest.
VALUE_ORDER = (
    "train ours", "train torch", "train torch:no-cudnn", "decode 0 beam4", "decode 0 greedy",
    "train ours:compiled", "train ours:compiled-layers", "decode 1 beam4", "decode 1 greedy",
    "train torch:compiled", "train marian",
)  # fmt: skip


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
    parser.add_argument(
        "--decode-methods", default=",".join(METHOD_KEYS), help="decoders to run (ours: the paired reference)"
    )
    parser.add_argument("--skip", default="", help="train and/or decode")
    parser.add_argument(
        "--budget-s", type=float, default=480, help="seconds for all cases; the rest are reported as skipped"
    )
    parser.add_argument("--case-timeout", type=float, default=240, help="the time box of one case (seconds)")
    parser.add_argument(
        "--results-dir", default=None, help=f"where the output is written (default {RESULTS_DIR / 'gpu'})"
    )
    args = parser.parse_args(argv)
    if args.smoke:  # the same code path at toy sizes; compiled by Dynamo only (backend eager)
        args.device = args.device or "cpu"
        args.vocab, args.batch_tokens, args.steps, args.warmup = 1000, 300, 2, 1
        args.decode_batch_sizes, args.decode_batches, args.decode_length = "4,8", 1, 5
        args.decode_repeats, args.compile_backend = 1, "eager"
    args.device = args.device or "cuda"
    args.decode_batch_sizes = [int(size) for size in args.decode_batch_sizes.split(",")]
    args.decode_methods = args.decode_methods.split(",")
    unknown = sorted(set(args.decode_methods) - set(METHOD_KEYS))
    if unknown:
        expected = ", ".join(METHOD_KEYS)
        parser.error(f"--decode-methods: unknown {', '.join(unknown)}; expected some of {expected}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False here); --smoke runs on the CPU")
    args.bf16 = args.device == "cuda"
    if args.results_dir is None and not args.smoke:
        args.results_dir = str(RESULTS_DIR / "gpu")
    return args


def describe(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The GPU (or CPU), its bf16 peak from the data-sheet table, versions; printed and returned."""
    import transformers

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = gpu_bf16_peak_tflops(name)
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
        print(
            f"no data-sheet bf16 peak for {name!r} in common.machine.GPU_BF16_PEAK_TFLOPS: MFU not reported"
        )
    return info


def training_header(args: argparse.Namespace, batches: list[Any]) -> None:
    timed = batches[args.warmup :]
    print(
        f"\nTraining, {len(timed)} timed steps after {args.warmup} warm-up, batches of "
        f"{sum(b.n_tokens for b in timed) / len(timed):.0f} non-pad tokens (source + target), "
        f"{sum(b.src.size(0) for b in timed) / len(timed):.0f} pairs, "
        f"{100 * sum(b.pad_fraction for b in timed) / len(timed):.1f}% padding"
    )
    print(f"MFU FLOPs: {FLOPS_FORMULA}")
    print("(frames: what Dynamo compiled, 1 = one graph; every graph break and recompilation adds one)")
    print(f"{'model':26} {'tok/s':>10} {'MFU %':>6} {'TFLOP/s':>8} {'step s':>7} {'peak GB':>8} ", end="")
    print(f"{'compile s':>9} {'frames':>6}")


def _not_run(row: dict[str, Any]) -> str | None:
    """'failed: why' or 'skipped: why' for a case that did not run to its end, else None."""
    for key, word in (("error", "failed"), ("skipped", "skipped")):
        if isinstance(row.get(key), str):
            return f"{word}: {row[key]}"
    return None


def training_row(name: str, row: dict[str, Any]) -> None:
    if _not_run(row):
        print(f"{name:26} {_not_run(row)}")
        return
    mfu = f"{row['mfu_pct']:6.1f}" if row.get("mfu_pct") is not None else f"{'-':>6}"
    mem = f"{row['peak_mem_gb']:8.1f}" if "peak_mem_gb" in row else f"{'-':>8}"
    comp = (
        f"{row['compile_s']:9.1f} {row['frames_compiled']:6d}" if "compile_s" in row else f"{'-':>9} {'-':>6}"
    )
    print(f"{name:26} {row['tok_s']:10.0f} {mfu} {row['tflops']:8.2f} {row['step_s']:7.3f} {mem} {comp}")


def decoding_header(args: argparse.Namespace, ctranslate2: str) -> None:
    print(
        f"\nDecoding, {args.decode_batches} batches of each size, every sentence {args.decode_length} "
        f"tokens, median of {args.decode_repeats} interleaved rounds; CTranslate2: {ctranslate2}"
    )
    print("(first s: the untimed warm-up round over the same batches: compiling and CUDA graphs included)")
    print("(same: the share of sentences whose tokens equal ours eager's, for ours' other steps)")
    head = f"{'case':14} {'method':22} {'sent/s':>9} {'tok/s':>10} {'mean len':>8} {'ours x':>7}"
    print(f"{head} {'first s':>7} {'same':>5}")


def decoding_rows(case: str, methods: dict[str, Any]) -> None:
    if _not_run(methods):
        print(f"{case:14} {_not_run(methods)}")
        return
    for name, row in methods.items():
        if "error" in row:
            print(f"{case:14} {name:22} failed: {row['error']}")
            continue
        speedup = f"{row['ours_speedup']:7.2f}" if "ours_speedup" in row else f"{'':>7}"
        cells = f"{row['sent_s']:9.1f} {row['tok_s']:10.0f} {row['mean_length']:8.1f}"
        first = f"{row['first_s']:7.2f}" if "first_s" in row else f"{'':>7}"
        same = f"{row['same_as_ours']:5.2f}" if row.get("same_as_ours") is not None else f"{'':>5}"
        print(f"{case:14} {name:22} {cells} {speedup} {first} {same}")


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def case_order(args: argparse.Namespace) -> list[str]:
    """The cases to run, most valuable first (VALUE_ORDER; others after, in the order given)."""
    skip = set(args.skip.split(","))
    names = [] if "train" in skip else [f"train {model}" for model in args.models.split(",")]
    if "decode" not in skip:
        names += [f"decode {i} {mode}" for i in range(len(args.decode_batch_sizes)) for mode in MODES]
    rank = {name: i for i, name in enumerate(VALUE_ORDER)}
    return sorted(names, key=lambda name: rank.get(name, len(rank)))


class Cases:
    """Runs one case at a time into `result`, building what a kind of case shares (the training batches,
    the decoding models) on its first case, inside that case's time box."""

    def __init__(self, args: argparse.Namespace, config: TransformerConfig, device: torch.device) -> None:
        self.args, self.config, self.device = args, config, device
        self.batches: list[Any] | None = None
        self.decoder: DecodingBench | None = None
        self.result: dict[str, Any] = {"train": {}, "decode": {}}

    def run(self, name: str) -> None:
        kind, _, rest = name.partition(" ")
        if kind == "train":
            if self.batches is None:
                n = self.args.warmup + self.args.steps
                batches = wmt_batches(n, self.args.batch_tokens, self.args.vocab)
                self.batches = [b.to(self.device) for b in batches]
                training_header(self.args, self.batches)
            row = run_training_case(rest, self.config, self.batches, self.args, self.device)
            self.result["train"][rest] = row
            training_row(rest, row)
            return
        index, mode = rest.split()
        size = self.args.decode_batch_sizes[int(index)]
        if self.decoder is None:
            self.decoder = DecodingBench(self.config, self.args, self.device)
            self.result["decode"]["ctranslate2"] = self.decoder.ctranslate2
            decoding_header(self.args, self.decoder.ctranslate2)
        self.result["decode"][f"batch{size}_{mode}"] = rows = self.decoder.case(size, mode)
        decoding_rows(f"batch{size}_{mode}", rows)

    def record(self, name: str, why: dict[str, str]) -> None:
        """A case that did not finish (its time box) or did not start (the budget): in the table too."""
        kind, _, rest = name.partition(" ")
        if kind == "train":
            self.result["train"][rest] = why
            training_row(rest, why)
        else:
            index, mode = rest.split()
            case = f"batch{self.args.decode_batch_sizes[int(index)]}_{mode}"
            self.result["decode"][case] = why
            decoding_rows(case, why)


def summary(args: argparse.Namespace, cases: Cases) -> None:
    """The rows printed as each case finished, again as two whole tables."""
    print("\n=== Summary (the rows above, by table)")
    if cases.result["train"]:
        if cases.batches is not None:
            training_header(args, cases.batches)
        for name, row in cases.result["train"].items():
            training_row(name, row)
    decode = {k: v for k, v in cases.result["decode"].items() if k != "ctranslate2"}
    if decode:
        decoding_header(args, cases.result["decode"].get("ctranslate2", "not built"))
        for case, rows in decode.items():
            decoding_rows(case, rows)


def run(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """Every case into `result` (describe()'s), in value order under the budget; the summary last."""
    device = torch.device(args.device)
    config = TransformerConfig(src_vocab_size=args.vocab, max_len=256, **(SMOKE if args.smoke else WMT_BASE))
    cases = Cases(args, config, device)
    deadline = time.monotonic() + args.budget_s
    for name in case_order(args):
        left = deadline - time.monotonic()
        if left <= 0:
            cases.record(name, {"skipped": f"the time budget (--budget-s {args.budget_s:g}) was spent"})
            continue
        try:
            with time_limit(min(args.case_timeout, left)):
                cases.run(name)
        except Exception as error:  # the time box, or a failure outside the per-method reports
            cases.record(name, {"error": f"{type(error).__name__}: {str(error).strip()[:200]}"})
    if cases.decoder is not None:
        cases.decoder.close()
    result.update({k: v for k, v in cases.result.items() if v})
    summary(args, cases)
    result["ratios"] = ratios(result)
    result["targets"] = TARGETS
    result["target_checks"] = target_checks(result)
    print_targets(result["target_checks"])
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # why each recompilation and graph break happened, on stderr (the "frames" column counts them)
    torch._logging.set_logs(recompiles=True, graph_breaks=True)
    with logged_stdout() as log:
        info = describe(args, torch.device(args.device))
        if args.results_dir:
            path = results_path(args.results_dir, info)
            log.open(path, f"python -m benchmarks.gpu.bench_gpu {' '.join(argv or sys.argv[1:])}")
        run(args, info)


if __name__ == "__main__":
    main()
