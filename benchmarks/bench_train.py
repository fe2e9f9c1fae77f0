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

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_train.py [--cases d256,d512] [--steps 5]
        [--models ours,torch,marian] [--baseline REV] [--skip e2e,rss,profile] [--quick]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning under load

import argparse
import ctypes
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from references import (  # noqa: E402
    PAD,
    Batch,
    MarianReference,
    TorchReference,
    batch_from_ids,
    batch_from_lengths,
    load_revision,
    make_batches,
    matmul_flops,
    measure_matmul_peak,
    model_flops,
    profile_split,
)

from transformer import losses as our_losses  # noqa: E402
from transformer.config import TransformerConfig  # noqa: E402
from transformer.model import Seq2SeqTransformer  # noqa: E402

CASES = {
    "d256": {"d_model": 256, "n_heads": 4, "n_encoder_layers": 3, "n_decoder_layers": 3, "d_ff": 1024},
    "d512": {"d_model": 512, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6, "d_ff": 2048},
}
VOCAB = 10_000
LABEL_SMOOTHING = 0.1
# Peak dense bf16 tensor-core TFLOP/s by device name (vendor data sheets), for GPU MFU.
GPU_BF16_PEAK_TFLOPS = {"H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H200": 989.4,
                        "A100": 312.0, "L40S": 362.1, "L4": 121.0, "A10G": 125.0, "RTX 4090": 165.2}  # fmt: skip


def tune_malloc() -> None:
    """glibc: no mmap / no trim for large buffers, as train.py's `tune_malloc: true` (shared/PERF.md)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD


# --- the competitors -------------------------------------------------------------------------------


def ours_token_loss(model: nn.Module, batch: Batch, losses: ModuleType) -> Tensor:
    """Our training loss, as TranslationTask computes it (only non-pad target positions are projected)."""
    keep = batch.tgt_out.ne(PAD)  # (B, T)
    if hasattr(model, "pack_tokens"):
        hidden = model(batch.src, batch.tgt_in, return_hidden=True, positions=keep)  # (N, D)
    else:  # revisions before `positions`
        hidden = model(batch.src, batch.tgt_in, return_hidden=True)[keep]  # (N, D)
    logits = model.output_projection(hidden)  # (N, V)
    return losses.label_smoothed_cross_entropy(
        logits, batch.tgt_out[keep], ignore_index=PAD, label_smoothing=LABEL_SMOOTHING
    ).loss


def reference_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Logits at every position, then torch's label-smoothed cross entropy ignoring pads."""
    logits = model(batch.src, batch.tgt_in)  # (B, T, V)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        batch.tgt_out.reshape(-1),
        ignore_index=PAD,
        label_smoothing=LABEL_SMOOTHING,
    )


@dataclass
class Runner:
    """One competitor: a model, its optimizer and its loss; `packed` = its linear layers skip padding."""

    name: str
    model: nn.Module
    loss_fn: Callable[[Batch], Tensor]
    packed: bool
    optimizer: torch.optim.Optimizer = field(init=False)
    autocast: torch.dtype | None = None

    def __post_init__(self) -> None:
        params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)

    def step(self, batch: Batch) -> float:
        device = batch.src.device
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=self.autocast or torch.bfloat16, enabled=bool(self.autocast)):
            loss = self.loss_fn(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"{self.name}: non-finite loss")
        return elapsed


def build_runner(name: str, config: TransformerConfig, revisions: dict[str, dict[str, ModuleType]]) -> Runner:
    torch.manual_seed(0)
    if name == "ours":
        model = Seq2SeqTransformer(config)
        return Runner(name, model, lambda b: ours_token_loss(model, b, our_losses), packed=_packs(model))
    if name.startswith("ours@"):
        modules = revisions[name.split("@", 1)[1]]
        old_config = modules["config"].TransformerConfig(**vars(config))
        model = modules["model"].Seq2SeqTransformer(old_config)
        return Runner(name, model, lambda b: ours_token_loss(model, b, modules["losses"]), packed=_packs(model))
    if name == "torch":
        model = TorchReference(config)
        return Runner(name, model, lambda b: reference_loss(model, b), packed=False)
    if name == "marian":
        model = MarianReference(config)
        return Runner(name, model, lambda b: reference_loss(model, b), packed=False)
    raise ValueError(f"unknown model {name!r}; expected ours, ours@REV, torch or marian")


def _packs(model: nn.Module) -> bool:
    """Whether this version of our model runs its linear layers on non-pad tokens only."""
    return bool(getattr(model, "pack_tokens", False))


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
    hfu = [
        matmul_flops(config, batch, packed=runner.packed) / seconds / 1e9 / peak_gflops for batch, seconds in steps
    ]
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
    return {"tok_s": tokens / seconds, "seconds": seconds, "batches": len(times), "pad_pct": 100 * (1 - tokens / cells)}


def multi30k_pairs(data_dir: str | None, n: int, seed: int) -> tuple[list[tuple[list[int], list[int]]], str]:
    """`n` random training pairs as token ids [BOS .. EOS] per side, and where their lengths come from."""
    rng = np.random.default_rng(seed)
    if data_dir and Path(data_dir).is_dir():
        from data.sources import load_multi30k
        from data.tokenization import train_bpe

        train = load_multi30k(data_dir, ["train"], "de", "en")["train"]
        sources, targets = train["src"][:], train["tgt"][:]
        tokenizer = train_bpe(sources + targets, VOCAB)
        pick = rng.choice(len(sources), size=n, replace=False).tolist()
        src_ids = tokenizer.encode_batch([sources[i] for i in pick])
        tgt_ids = tokenizer.encode_batch([targets[i] for i in pick])
        return list(zip(src_ids, tgt_ids)), f"Multi30k train de-en, joint BPE {tokenizer.vocab_size}"
    # stand-in: lengths like Multi30k's under BPE (mean ~15-16, long right tail), random ids
    lengths = np.clip(rng.gamma(6.0, 2.6, size=(n, 2)).round().astype(int) + 3, 5, 60)
    pairs = [
        (
            [1, *rng.integers(4, VOCAB, size=s - 2).tolist(), 2],
            [1, *rng.integers(4, VOCAB, size=t - 2).tolist(), 2],
        )
        for s, t in lengths
    ]
    return pairs, "synthetic Multi30k-like lengths (no MULTI30K_DIR): gamma(6, 2.6) + 3"


def e2e_schedules(
    pairs: list[tuple[list[int], list[int]]], max_tokens: int, batch_size: int, seed: int
) -> tuple[list[Batch], list[Batch]]:
    """The same sentences as bucketed token-budget batches (ours) and as random batches of `batch_size`."""
    from data.batching import TokenBudgetBatchSampler

    # the datamodule's length of a pair: max(source, target input) (data/batching.py)
    lengths = [max(len(s), len(t) - 1) for s, t in pairs]
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, shuffle=True, seed=seed)
    bucketed = [batch_from_ids([pairs[i] for i in indices]) for indices in sampler]
    order = np.random.default_rng(seed).permutation(len(pairs)).tolist()
    random_batches = [
        batch_from_ids([pairs[i] for i in order[start : start + batch_size]])
        for start in range(0, len(order), batch_size)
    ]
    return bucketed, random_batches


def rss_child(name: str, case: str, steps: int, baseline: str | None) -> None:
    """Subprocess body: build one model, run training steps on fixed batches, print peak RSS as JSON."""
    tune_malloc()
    config = TransformerConfig(src_vocab_size=VOCAB, max_len=128, **CASES[case])  # type: ignore[arg-type]
    revisions = {baseline: load_revision(baseline)} if baseline else {}
    batches = make_batches(steps, 128, VOCAB, torch.Generator().manual_seed(0))
    runner = build_runner(name, config, revisions)
    built_mb = _status_mb("VmRSS")
    for batch in batches:
        runner.step(batch)
    peak_mb = _status_mb("VmHWM")  # not ru_maxrss: Linux carries that over from the parent across exec
    print(json.dumps({"model": name, "built_rss_mb": built_mb, "peak_rss_mb": peak_mb}))


def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: now, VmHWM: peak) in MiB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_rss(names: list[str], case: str, steps: int, baseline: str | None, threads: int) -> dict[str, dict]:
    results = {}
    for name in names:
        command = [sys.executable, __file__, "--rss-child", name, "--cases", case, "--threads", str(threads)]
        command += ["--rss-steps", str(steps)] + (["--baseline", baseline] if baseline else [])
        out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
        if out.returncode:
            raise RuntimeError(f"RSS subprocess for {name} failed:\n{out.stderr[-2000:]}")
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


# --- main ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="d256,d512", help="comma-separated subset of " + ",".join(CASES))
    parser.add_argument("--models", default="ours,torch,marian", help="ours, torch, marian (ours@REV via --baseline)")
    parser.add_argument("--baseline", default=None, help="git revision of our model to add as 'ours@REV'")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per model (padded)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--e2e-sentences", type=int, default=1024, help="sentences in the end-to-end epoch")
    parser.add_argument("--e2e-max-tokens", type=int, default=4096, help="token budget of our bucketed batches")
    parser.add_argument("--e2e-cases", default="d256,d512")
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR"), help="Multi30k raw (de, en)")
    parser.add_argument("--profile-steps", type=int, default=1)
    parser.add_argument("--rss-steps", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: padded, e2e, profile, rss")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-tune-malloc", action="store_true", help="keep glibc's default malloc behaviour")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", action="store_true", help="torch.compile every model (counts recompiles)")
    parser.add_argument("--quick", action="store_true", help="tiny run: checks that the script works")
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        rss_child(args.rss_child, args.cases.split(",")[0], args.rss_steps, args.baseline)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, but torch.cuda.is_available() is False on this machine")
    if not args.no_tune_malloc and args.device == "cpu":
        tune_malloc()
    if args.quick:
        args.steps, args.batch_size, args.e2e_sentences, args.rss_steps = 1, 16, 96, 1
    device = torch.device(args.device)
    skip = set(filter(None, args.skip.split(",")))
    names = args.models.split(",") + ([f"ours@{args.baseline}"] if args.baseline else [])
    revisions = {args.baseline: load_revision(args.baseline)} if args.baseline else {}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = measure_matmul_peak(device, dtype)
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        sheet = next((tflops for key, tflops in GPU_BF16_PEAK_TFLOPS.items() if key in name), None)
        peak["datasheet_bf16"] = sheet * 1000 if sheet else float("nan")
        peak["peak"] = sheet * 1000 if sheet else peak["peak"]
    load = os.getloadavg()
    header = (
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
        f"malloc tuned: {not args.no_tune_malloc}, device {device}"
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
        + f", load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, matmul peak {peak['peak']:.0f} GFLOP/s "
        + "(" + ", ".join(f"{k} {v:.0f}" for k, v in peak.items() if k != "peak") + ")"
    )
    print(header, flush=True)
    result: dict[str, object] = {"benchmark": "bench_train", "torch": torch.__version__, "threads": torch.get_num_threads(),
                                 "device": str(device), "peak_gflops": round(peak["peak"], 1), "load_start": load[0]}  # fmt: skip
    ratios: dict[str, float] = {}

    for case in args.cases.split(","):
        config = TransformerConfig(src_vocab_size=VOCAB, max_len=256, **CASES[case])  # type: ignore[arg-type]
        runners = {name: build_runner(name, config, revisions) for name in names}
        for runner in runners.values():
            runner.model.to(device).train()
            runner.autocast = torch.bfloat16 if device.type == "cuda" else None
            if args.compile:
                runner.model.compile(dynamic=True)
        if "padded" not in skip:
            gen = torch.Generator().manual_seed(0)
            batches = [b.to(device) for b in make_batches(args.warmup + args.steps, args.batch_size, VOCAB, gen)]
            times = interleaved(runners, {name: batches for name in runners}, args.warmup)
            rows = {name: summarize(runners[name], config, times[name], peak["peak"]) for name in runners}
            result[f"{case}_padded"] = {name: {k: round(v, 2) for k, v in row.items()} for name, row in rows.items()}
            print(f"\n[{case}] padded batches of {args.batch_size} pairs, {args.steps} timed steps each")
            print(f"{'model':14} {'tok/s':>8} {'step s':>7} {'MFU %':>6} {'HFU %':>6} {'pad %':>6} {'ours/it':>8}")
            for name, row in rows.items():
                rel = rows["ours"]["tok_s"] / row["tok_s"] if "ours" in rows else float("nan")
                print(f"{name:14} {row['tok_s']:8.0f} {row['step_s']:7.2f} {row['mfu_pct']:6.1f} "
                      f"{row['hfu_pct']:6.1f} {row['pad_pct']:6.1f} {rel:8.2f}")  # fmt: skip
                if name != "ours" and "ours" in rows:
                    ratios[f"{case}_padded_ours_vs_{name}"] = rel
            if "profile" not in skip:
                print(f"[{case}] profile, % of self CPU time ({args.profile_steps} step(s) each)")
                splits = {name: profile_runner(r, batches[: args.profile_steps]) for name, r in runners.items()}
                cats = list(next(iter(splits.values())))
                print(f"{'model':14} " + " ".join(f"{c:>12}" for c in cats))
                for name, split in splits.items():
                    print(f"{name:14} " + " ".join(f"{split[c]:12.1f}" for c in cats))
                result[f"{case}_profile"] = {n: {k: round(v, 1) for k, v in s.items()} for n, s in splits.items()}
        if "e2e" not in skip and case in args.e2e_cases.split(","):
            pairs, source = multi30k_pairs(args.data_dir, args.e2e_sentences, seed=0)
            bucketed, random_batches = e2e_schedules(pairs, args.e2e_max_tokens, args.batch_size, seed=0)
            bucketed, random_batches = [b.to(device) for b in bucketed], [b.to(device) for b in random_batches]
            e2e_runners = {f"{name} random": runners[name] for name in runners}
            e2e_runners.update({f"{name} bucketed": runners[name] for name in runners if name.startswith("ours")})
            schedule = {key: bucketed if key.endswith("bucketed") else random_batches for key in e2e_runners}
            for name in runners:  # one untimed step on each batch shape family first
                runners[name].step(random_batches[0])
            times = interleaved(e2e_runners, schedule, warmup=0)
            rows = {name: epoch_throughput(t) for name, t in times.items()}
            print(f"\n[{case}] end to end: {len(pairs)} sentences ({source}); ours bucketed: "
                  f"TokenBudgetBatchSampler(max_tokens={args.e2e_max_tokens}); random: {args.batch_size} per batch")  # fmt: skip
            print(f"{'model, batches':22} {'tok/s':>8} {'epoch s':>8} {'batches':>8} {'pad %':>6} {'vs it':>6}")
            best = rows.get("ours bucketed", {}).get("tok_s", float("nan"))
            for name, row in rows.items():
                print(f"{name:22} {row['tok_s']:8.0f} {row['seconds']:8.1f} {row['batches']:8d} "
                      f"{row['pad_pct']:6.1f} {best / row['tok_s']:6.2f}")  # fmt: skip
                if not name.startswith("ours bucketed"):
                    ratios[f"{case}_e2e_ours_bucketed_vs_{name.replace(' ', '_')}"] = best / row["tok_s"]
            result[f"{case}_e2e"] = {"lengths": source, **{n: {k: round(v, 2) for k, v in r.items()} for n, r in rows.items()}}
        if args.compile:
            from torch._dynamo.utils import counters

            result[f"{case}_compile_counters"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles")}
            print(f"[{case}] torch.compile counters: {result[f'{case}_compile_counters']}")
        del runners

    if "rss" not in skip and device.type == "cpu":
        rss_case = "d512" if not args.quick else "d256"
        rss_names = [n for n in names if n != "marian"] + (["marian"] if "marian" in names else [])
        rss = measure_rss(rss_names, rss_case, args.rss_steps, args.baseline, torch.get_num_threads())
        print(f"\n[{rss_case}] peak RSS of {args.rss_steps} training step(s), one fresh process per model (MB)")
        for name, row in rss.items():
            print(f"{name:14} built {row['built_rss_mb']:8.0f}  peak {row['peak_rss_mb']:8.0f}")
        result["rss_mb"] = {name: round(row["peak_rss_mb"]) for name, row in rss.items()}
        if "ours" in rss and "torch" in rss:
            ratios["rss_ours_vs_torch"] = rss["ours"]["peak_rss_mb"] / rss["torch"]["peak_rss_mb"]

    result["load_end"] = os.getloadavg()[0]
    result["ratios"] = {key: round(value, 3) for key, value in ratios.items()}
    print("\n" + json.dumps(result))


if __name__ == "__main__":
    main()
