"""Training-step throughput of ours vs torch.nn.Transformer vs transformers.MarianMTModel, side by side.

A step is forward + label-smoothed cross entropy (eps 0.1) + backward + AdamW (fused, same settings for
every model). Each model trains its own copy on the same batches; steps are interleaved (the order
rotates every step) and medians reported. Tokens/s counts non-pad source + target tokens.

- padded: B=128 pairs, lengths uniform in [10, 32] (~35% padding), at d256 (3+3 layers, 4 heads,
  d_ff 1024) and d512 (6+6, 8 heads, d_ff 2048), vocab 10k, tied embeddings, dropout 0.1.
- e2e: the same sentences as one "epoch": ours in our TokenBudgetBatchSampler's length-bucketed batches,
  the references in random batches of 128. Lengths are real Multi30k de-en lengths under a 10k joint BPE
  from data/tokenization.py when MULTI30K_DIR (or --data-dir) is set, else a synthetic stand-in.
- MFU: useful (non-pad) matmul FLOPs / time / the fp32 matmul peak measured in the same run; HFU: the
  matmul FLOPs each implementation actually executes (padded or packed).
- profile: self CPU time by op category from torch.profiler (matmul / attention / dropout /
  softmax+loss / elementwise / optimizer).
- rss: peak RSS of training steps at d512, each model in a fresh subprocess.
- --baseline REV adds our model as it was at git revision REV ("before") to every comparison.
- --device cuda: bf16 autocast, SDPA, optional --compile; MFU against the GPU's bf16 peak.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.train.bench_train [--cases d256,d512] [--steps 5]
        [--models ours,torch,marian] [--baseline REV] [--skip e2e,rss,profile] [--quick | --smoke]

`--quick`: one step of 16 pairs a model, 96 sentences end to end; `--smoke`: the same at a tiny shape (the
"smoke" case, d_model 32, 1+1 layers), without the per-model RSS processes: a check of the code path.

Prints a table, then one JSON line. The competitors are built in train_runners.py, the end-to-end
sentences in train_epoch.py, malloc tuning and peak RSS in train_memory.py, the tables in train_report.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning under load

import argparse
import json
import platform
import statistics
from types import ModuleType

import torch

from benchmarks.common.machine import gpu_bf16_peak_tflops
from benchmarks.common.references import (
    Batch,
    load_revision,
    make_batches,
    measure_matmul_peak,
    model_flops,
    profile_split,
)  # fmt: skip
from benchmarks.train.epoch import e2e_schedules, multi30k_pairs
from benchmarks.train.memory import measure_rss, rss_child, tune_malloc
from benchmarks.train.report import print_e2e, print_padded, print_profile, print_summary, rounded
from benchmarks.train.runners import CASES, VARIANTS, VOCAB, Runner, build_runner
from transformer.config import TransformerConfig

# --- measurements ----------------------------------------------------------------------------------


def interleaved(
    runners: dict[str, Runner], schedule: dict[str, list[Batch]], warmup: int
) -> dict[str, list[tuple[Batch, float]]]:
    """Run every model on its own batch list, round robin with a rotating order; (batch, seconds) pairs.

    The first `warmup` steps of each model are run but not recorded.
    """
    names = list(runners)
    times: dict[str, list[tuple[Batch, float]]] = {name: [] for name in names}
    rounds = max(len(batches) for batches in schedule.values())
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            if i < len(schedule[name]):
                seconds = runners[name].step(schedule[name][i])
                if i >= warmup:
                    times[name].append((schedule[name][i], seconds))
    return times


def summarize(
    runner: Runner, config: TransformerConfig, steps: list[tuple[Batch, float]], peak_gflops: float
) -> dict[str, float]:
    """Median tokens/s, MFU and HFU (percent of the measured matmul peak) over timed steps."""
    rates = [batch.n_tokens / seconds for batch, seconds in steps]
    mfu = [model_flops(config, batch) / seconds / 1e9 / peak_gflops for batch, seconds in steps]
    hfu = [runner.matmul_flops(config, batch) / seconds / 1e9 / peak_gflops for batch, seconds in steps]
    return {
        "tok_s": statistics.median(rates),
        "mfu_pct": 100 * statistics.median(mfu),
        "hfu_pct": 100 * statistics.median(hfu),
        "step_s": statistics.median(seconds for _, seconds in steps),
        "pad_pct": 100 * statistics.mean(batch.pad_fraction for batch, _ in steps),
    }


def profile_runner(runner: Runner, batches: list[Batch]) -> dict[str, float]:
    """Where a step's time goes (percent of self CPU time per op category) over `batches`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for batch in batches:
            runner.step(batch)
    return profile_split(prof)


def epoch_throughput(times: list[tuple[Batch, float]]) -> dict[str, float]:
    """Tokens / seconds summed over a whole epoch of (possibly differently sized) batches."""
    tokens = sum(batch.n_tokens for batch, _ in times)
    seconds = sum(s for _, s in times)
    cells = sum(batch.src.numel() + batch.tgt_out.numel() for batch, _ in times)
    return {
        "tok_s": tokens / seconds,
        "seconds": seconds,
        "batches": len(times),
        "pad_pct": 100 * (1 - tokens / cells),
    }


def _peak(device: torch.device, bf16: bool, repeats: int = 20) -> dict[str, float]:
    """Measured matmul ceiling in GFLOP/s (bf16 on GPUs, where the data-sheet peak is used if known)."""
    peak = measure_matmul_peak(device, torch.bfloat16 if bf16 else torch.float32, repeats)
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        sheet = gpu_bf16_peak_tflops(name)
        if sheet:
            peak["datasheet"] = sheet * 1000
            peak["peak"] = sheet * 1000
    return peak


# --- one case: padded batches, profile, end to end --------------------------------------------------


def build_runners(
    case: str,
    args: argparse.Namespace,
    names: list[str],
    revisions: dict[str, dict[str, ModuleType]],
    device: torch.device,
) -> tuple[TransformerConfig, dict[str, Runner]]:
    """Every competitor at the size of `case`, in training mode on `device` (bf16 autocast, compiled)."""
    config = TransformerConfig(src_vocab_size=VOCAB, max_len=256, **CASES[case])  # type: ignore[arg-type]
    runners = {name: build_runner(name, config, revisions, device) for name in names}
    for runner in runners.values():
        runner.model.to(device).train()
        runner.autocast = torch.bfloat16 if args.bf16 else None
        if args.compile:
            if hasattr(runner.model, "pack_tokens"):
                runner.model.pack_tokens = False  # data-dependent shapes would break the graphs
                runner.packed = False
            runner.model.compile(dynamic=True)
    return config, runners


def measure_padded(
    case: str,
    args: argparse.Namespace,
    config: TransformerConfig,
    runners: dict[str, Runner],
    batches: list[Batch],
    peak: float,
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Interleaved steps on the same padded batches: (rounded rows per model, ratios against ours)."""
    times = interleaved(runners, {name: batches for name in runners}, args.warmup)
    rows = {name: summarize(runners[name], config, times[name], peak) for name in runners}
    ratios = {}
    for name in rows:
        if name != "ours" and "ours" in rows:
            # per step, the same batch ran seconds apart: the median of these ratios shrugs off drift
            paired = [theirs / mine for (_, mine), (_, theirs) in zip(times["ours"], times[name])]
            ratios[f"{case}_padded_ours_vs_{name}"] = statistics.median(paired)
    print_padded(case, rows, ratios, args.steps, args.batch_size)
    return rounded(rows), ratios


def measure_e2e(
    case: str, args: argparse.Namespace, runners: dict[str, Runner], device: torch.device
) -> tuple[dict[str, object], dict[str, float]]:
    """One epoch over the same sentences: ours bucketed and every model in random batches; (rows, ratios)."""
    pairs, source = multi30k_pairs(args.data_dir, args.e2e_sentences, seed=0)
    bucketed, random_batches = e2e_schedules(pairs, args.e2e_max_tokens, args.batch_size, seed=0)
    bucketed = [batch.to(device) for batch in bucketed]
    random_batches = [batch.to(device) for batch in random_batches]
    e2e = {f"{name} random": runners[name] for name in runners}
    e2e.update({f"{name} bucketed": runners[name] for name in runners if name.startswith("ours")})
    schedule = {key: bucketed if key.endswith("bucketed") else random_batches for key in e2e}
    for runner in runners.values():  # one untimed step on real-data shapes first
        runner.step(random_batches[0])
    times = interleaved(e2e, schedule, warmup=0)
    rows = {name: epoch_throughput(t) for name, t in times.items()}
    print_e2e(case, rows, source, args.e2e_max_tokens, args.batch_size)
    ratios = {}
    for name in rows:
        if name != "ours bucketed" and "ours bucketed" in rows:
            key = f"{case}_e2e_ours_bucketed_vs_{name.replace(' ', '_')}"
            ratios[key] = rows["ours bucketed"]["tok_s"] / rows[name]["tok_s"]
    return {"lengths": source, **rounded(rows)}, ratios


def run_case(
    case: str,
    args: argparse.Namespace,
    names: list[str],
    revisions: dict[str, dict[str, ModuleType]],
    device: torch.device,
    peak: float,
) -> tuple[dict[str, object], dict[str, float]]:
    """Padded batches, profile and end to end for one model size; (JSON results, ratios)."""
    config, runners = build_runners(case, args, names, revisions, device)
    result: dict[str, object] = {}
    ratios: dict[str, float] = {}
    skip = set(filter(None, args.skip.split(",")))
    batches = make_batches(args.warmup + args.steps, args.batch_size, VOCAB, torch.Generator().manual_seed(0))
    batches = [batch.to(device) for batch in batches]
    if "padded" not in skip:
        result[f"{case}_padded"], padded_ratios = measure_padded(case, args, config, runners, batches, peak)
        ratios.update(padded_ratios)
    if "profile" not in skip and device.type == "cpu":
        splits = {name: profile_runner(r, batches[: args.profile_steps]) for name, r in runners.items()}
        print_profile(case, splits, args.profile_steps)
        result[f"{case}_profile"] = rounded(splits, 1)
    if "e2e" not in skip and case in args.e2e_cases.split(","):
        result[f"{case}_e2e"], e2e_ratios = measure_e2e(case, args, runners, device)
        ratios.update(e2e_ratios)
    if args.compile or any(name.endswith(":compiled") for name in names):
        from torch._dynamo.utils import counters

        result[f"{case}_compile_counters"] = {
            key: dict(value) for key, value in counters.items() if key in ("stats", "recompiles")
        }
        print(f"[{case}] torch.compile counters: {result[f'{case}_compile_counters']}")
    return result, ratios


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="d256,d512", help="comma-separated subset of " + ",".join(CASES))
    parser.add_argument(
        "--models",
        default="ours,torch,marian",
        help=f"ours, ours:VARIANT ({', '.join(VARIANTS)}), torch, marian",
    )
    parser.add_argument("--baseline", default=None, help="git revision of our model to add as ours@REV")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per model (padded)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--e2e-sentences", type=int, default=1024, help="sentences in the end-to-end epoch")
    parser.add_argument("--e2e-max-tokens", type=int, default=4096, help="token budget of bucketed batches")
    parser.add_argument("--e2e-cases", default="d256,d512")
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR"), help="Multi30k raw (de, en)")
    parser.add_argument("--profile-steps", type=int, default=1)
    parser.add_argument("--rss-steps", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: padded,e2e,profile,rss")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-tune-malloc", action="store_true", help="keep glibc's default malloc")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (default on cuda)")
    parser.add_argument("--compile", action="store_true", help="torch.compile(dynamic=True) every model")
    parser.add_argument("--quick", action="store_true", help="tiny run: checks that the script works")
    parser.add_argument("--smoke", action="store_true", help="--quick at a tiny shape, no RSS processes")
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.rss_child and args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, but torch.cuda.is_available() is False here")
    return args


def describe_run(args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    """Print the run's setting (torch, device, threads, malloc, dtype, load); its JSON fields."""
    load = os.getloadavg()
    where = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"torch {torch.__version__}, {where}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, malloc tuned: {not args.no_tune_malloc}, "
        f"{'bf16 autocast' if args.bf16 else 'fp32'}{', compiled' if args.compile else ''}, "
        f"load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}",
        flush=True,
    )
    return {
        "benchmark": "bench_train",
        "torch": torch.__version__,
        "device": where,
        "threads": torch.get_num_threads(),
        "dtype": "bf16" if args.bf16 else "fp32",
        "load_start": load[0],
    }


def rss_part(args: argparse.Namespace, names: list[str]) -> tuple[dict[str, int], dict[str, float]]:
    """Peak RSS of each model's training steps in a fresh process: (MB per model, ratios against ours)."""
    rss_case = "d256" if args.quick else "d512"
    rss = measure_rss(names, rss_case, args.rss_steps, args.baseline, torch.get_num_threads())
    print(f"\n[{rss_case}] peak RSS (VmHWM) over {args.rss_steps} training steps, one fresh process each")
    for name, row in rss.items():
        print(f"{name:18} after building {row['built_rss_mb']:7.0f} MB, peak {row['peak_rss_mb']:7.0f} MB")
    ratios = {
        f"rss_ours_vs_{name}": rss["ours"]["peak_rss_mb"] / rss[name]["peak_rss_mb"]
        for name in rss
        if name != "ours" and "ours" in rss
    }
    return {name: round(row["peak_rss_mb"]) for name, row in rss.items()}, ratios


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        rss_child(args.rss_child, args.cases.split(",")[0], args.rss_steps, args.baseline)
        return
    device = torch.device(args.device)
    args.bf16 = args.bf16 or device.type == "cuda"
    if not args.no_tune_malloc and device.type == "cpu":
        tune_malloc()
    if args.smoke:
        args.quick, args.cases, args.e2e_cases, args.skip = True, "smoke", "smoke", f"{args.skip},rss"
    if args.quick:
        args.steps, args.batch_size, args.e2e_sentences, args.rss_steps = 1, 16, 96, 1
    names = args.models.split(",") + ([f"ours@{args.baseline}"] if args.baseline else [])
    revisions = {args.baseline: load_revision(args.baseline)} if args.baseline else {}
    repeats = 1 if args.smoke else 20  # a smoke run checks the code path: 40 big matmuls were half its time
    peak = _peak(device, args.bf16, repeats)
    result = describe_run(args, device)
    ratios: dict[str, float] = {}
    for case in args.cases.split(","):
        case_result, case_ratios = run_case(case, args, names, revisions, device, peak["peak"])
        result.update(case_result)
        ratios.update(case_ratios)
    if "rss" not in args.skip.split(",") and device.type == "cpu":
        result["rss_mb"], rss_ratios = rss_part(args, names)
        ratios.update(rss_ratios)

    # the ceiling again: on a shared machine one look can be unlucky
    end_peak = _peak(device, args.bf16, repeats)
    best = max(peak["peak"], end_peak["peak"])
    print(
        f"\nmatmul peak {best:.0f} GFLOP/s (start {peak['peak']:.0f}, end {end_peak['peak']:.0f}; "
        + ", ".join(f"{k} {v:.0f}" for k, v in peak.items() if k != "peak")
        + "); the tables above use the start value, the summary below the best"
    )
    result["peak_gflops"] = {"start": round(peak["peak"], 1), "end": round(end_peak["peak"], 1)}
    print_summary(result, ratios, peak["peak"] / best)
    result["load_end"] = os.getloadavg()[0]
    result["ratios"] = {key: round(value, 3) for key, value in ratios.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
