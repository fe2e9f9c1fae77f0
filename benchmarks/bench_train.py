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
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from references import (
    PAD,
    Batch,
    MarianReference,
    TorchReference,
    batch_from_ids,
    load_revision,
    make_batches,
    matmul_flops,
    measure_matmul_peak,
    model_flops,
    profile_split,
)

from transformer import losses as our_losses
from transformer.config import TransformerConfig
from transformer.layers import Dropout
from transformer.model import Seq2SeqTransformer

CASES = {
    "d256": {"d_model": 256, "n_heads": 4, "n_encoder_layers": 3, "n_decoder_layers": 3, "d_ff": 1024},
    "d512": {"d_model": 512, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6, "d_ff": 2048},
}
VOCAB = 10_000
LABEL_SMOOTHING = 0.1
# Peak dense bf16 tensor-core TFLOP/s by device name (vendor data sheets), for GPU MFU.
GPU_BF16_PEAK_TFLOPS = {
    "H100 80GB HBM3": 989.4,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.4,
    "A100": 312.0,
    "L40S": 362.1,
    "L4": 121.0,
    "A10G": 125.0,
}


def tune_malloc() -> None:
    """glibc: no mmap / no trim for large buffers, as train.py's `tune_malloc: true` (shared/PERF.md)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD


# --- the competitors -------------------------------------------------------------------------------


def ours_token_loss(model: nn.Module, batch: Batch, loss_fn: Callable[..., Tensor]) -> Tensor:
    """Our training loss, as TranslationTask computes it (only non-pad target positions are projected)."""
    keep = batch.tgt_out.ne(PAD)  # (B, T)
    if hasattr(model, "pack_tokens"):
        hidden = model(batch.src, batch.tgt_in, return_hidden=True, positions=keep)  # (N, D)
    else:  # revisions before `positions`
        hidden = model(batch.src, batch.tgt_in, return_hidden=True)[keep]  # (N, D)
    logits = model.output_projection(hidden)  # (N, V)
    return loss_fn(logits, batch.tgt_out[keep], ignore_index=PAD, label_smoothing=LABEL_SMOOTHING).loss


def autograd_token_loss(logits: Tensor, target: Tensor, *, ignore_index: int, label_smoothing: float) -> Any:
    """The label-smoothed loss and accuracy written with autograd ops (log-softmax, gather, mean, argmax):
    what transformer/losses.py computed before its fused version; for the `ours:autogradloss` variant."""
    lprobs = F.log_softmax(logits, dim=-1)  # (N, V)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (N,)
    loss = ((1 - label_smoothing) * nll - label_smoothing * lprobs.mean(dim=-1)).mean()
    with torch.no_grad():
        n_correct = (logits.argmax(dim=-1) == target).sum()
    return our_losses.TokenLoss(loss, nll.mean(), n_correct, torch.tensor(target.numel()))


def reference_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Logits at every position, then torch's label-smoothed cross entropy ignoring pads."""
    logits = model(batch.src, batch.tgt_in)  # (B, T, V)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        batch.tgt_out.reshape(-1),
        ignore_index=PAD,
        label_smoothing=LABEL_SMOOTHING,
    )


class TorchDropout(nn.Module):
    """torch's dropout behind our `Dropout`'s interface, for the `ours:torchdropout` variant."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        dropped = F.dropout(x, self.p, self.training)
        return dropped if residual is None else residual + dropped


@dataclass
class Runner:
    """One competitor: a model, its optimizer and its loss; where its matmuls skip padding (for HFU)."""

    name: str
    model: nn.Module
    loss_fn: Callable[[Batch], Tensor]
    packed: bool  # linear layers on non-pad tokens only
    packed_logits: bool  # vocabulary projection on non-pad target positions only
    optimizer: torch.optim.Optimizer = field(init=False)
    autocast: torch.dtype | None = None
    fused_adamw: bool = True

    def __post_init__(self) -> None:
        params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            params, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=self.fused_adamw, foreach=not self.fused_adamw
        )

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

    def matmul_flops(self, config: TransformerConfig, batch: Batch) -> float:
        return matmul_flops(config, batch, packed=self.packed, packed_logits=self.packed_logits)


# ours with one lever reverted, or (compiled) torch.compile(dynamic=True) added on the padded layout
VARIANTS = ("pack", "nopack", "torchdropout", "autogradloss", "foreachadamw", "compiled")


def build_runner(
    name: str,
    config: TransformerConfig,
    revisions: dict[str, dict[str, ModuleType]],
    device: torch.device = torch.device("cpu"),  # noqa: B008
) -> Runner:
    """ours, ours:VARIANT (one optimization reverted or forced), ours@REV (an earlier revision), torch or
    marian, for training on `device` (ours packs tokens by default on the CPU only)."""
    torch.manual_seed(0)
    if name == "ours" or name.startswith("ours:"):
        variant = name.partition(":")[2]
        if variant and variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
        model = Seq2SeqTransformer(config)
        if variant in ("pack", "nopack", "compiled"):  # packing's shapes depend on the data: not compiled
            model.pack_tokens = variant == "pack"
        if variant == "compiled":
            model.compile(dynamic=True)
        if variant == "torchdropout":
            for module in list(model.modules()):
                for child_name, child in module.named_children():
                    if isinstance(child, Dropout):
                        setattr(module, child_name, TorchDropout(child.p))
        loss_fn = (
            autograd_token_loss if variant == "autogradloss" else our_losses.label_smoothed_cross_entropy
        )
        return Runner(
            name,
            model,
            lambda b: ours_token_loss(model, b, loss_fn),
            model._packing_on(device),
            True,
            fused_adamw=variant != "foreachadamw",
        )
    if name.startswith("ours@"):
        modules = revisions[name.split("@", 1)[1]]
        old_config = modules["config"].TransformerConfig(**vars(config))
        model = modules["model"].Seq2SeqTransformer(old_config)
        packs = (
            model._packing_on(device)
            if hasattr(model, "_packing_on")
            else bool(getattr(model, "pack_tokens", False))
        )
        loss_fn = modules["losses"].label_smoothed_cross_entropy
        return Runner(name, model, lambda b: ours_token_loss(model, b, loss_fn), packs, True)
    if name == "torch":
        model = TorchReference(config)
        return Runner(name, model, lambda b: reference_loss(model, b), False, False)
    if name == "marian":
        model = MarianReference(config)
        return Runner(name, model, lambda b: reference_loss(model, b), False, False)
    raise ValueError(f"unknown model {name!r}; expected ours, ours:VARIANT, ours@REV, torch or marian")


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


def measure_rss(
    names: list[str], case: str, steps: int, baseline: str | None, threads: int
) -> dict[str, dict]:
    results = {}
    for name in names:
        command = [sys.executable, __file__, "--rss-child", name, "--cases", case, "--threads", str(threads)]
        command += ["--rss-steps", str(steps)] + (["--baseline", baseline] if baseline else [])
        out = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        )
        if out.returncode:
            raise RuntimeError(f"RSS subprocess for {name} failed:\n{out.stderr[-2000:]}")
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


# --- main ------------------------------------------------------------------------------------------


def _peak(device: torch.device, bf16: bool) -> dict[str, float]:
    """Measured matmul ceiling in GFLOP/s (bf16 on GPUs, where the data-sheet peak is used if known)."""
    peak = measure_matmul_peak(device, torch.bfloat16 if bf16 else torch.float32)
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        sheet = next((tflops for key, tflops in GPU_BF16_PEAK_TFLOPS.items() if key in name), None)
        if sheet:
            peak["datasheet"] = sheet * 1000
            peak["peak"] = sheet * 1000
    return peak


def _print_padded(
    case: str, rows: dict[str, dict[str, float]], ratios: dict[str, float], steps: int, batch_size: int
) -> None:
    print(f"\n[{case}] padded batches of {batch_size} pairs, median of {steps} interleaved steps")
    print(f"{'model':18} {'tok/s':>8} {'step s':>7} {'MFU %':>6} {'HFU %':>6} {'pad %':>6} {'ours/it':>8}")
    print("  (ours/it: median over steps of its step time / ours, on the same batch)")
    for name, row in rows.items():
        rel = ratios.get(f"{case}_padded_ours_vs_{name}", 1.0 if name == "ours" else float("nan"))
        print(
            f"{name:18} {row['tok_s']:8.0f} {row['step_s']:7.2f} {row['mfu_pct']:6.1f} "
            f"{row['hfu_pct']:6.1f} {row['pad_pct']:6.1f} {rel:8.2f}"
        )


def _print_profile(case: str, splits: dict[str, dict[str, float]], steps: int) -> None:
    print(f"[{case}] where the time goes: % of self CPU time by op category ({steps} step(s) each)")
    categories = list(next(iter(splits.values())))
    print(f"{'model':18} " + " ".join(f"{c:>12}" for c in categories))
    for name, split in splits.items():
        print(f"{name:18} " + " ".join(f"{split[c]:12.1f}" for c in categories))


def _print_e2e(case: str, rows: dict[str, dict[str, float]], source: str, max_tokens: int, size: int) -> None:
    print(f"\n[{case}] end to end, one epoch over the same sentences ({source})")
    print(f"  bucketed: TokenBudgetBatchSampler(max_tokens={max_tokens}); random: {size} sentences per batch")
    print(f"{'model, batches':24} {'tok/s':>8} {'epoch s':>8} {'batches':>8} {'pad %':>6} {'ours/it':>8}")
    best = rows.get("ours bucketed", {}).get("tok_s", float("nan"))
    for name, row in rows.items():
        print(
            f"{name:24} {row['tok_s']:8.0f} {row['seconds']:8.1f} {row['batches']:8d} "
            f"{row['pad_pct']:6.1f} {best / row['tok_s']:8.2f}"
        )


def _print_summary(result: dict[str, object], ratios: dict[str, float], rescale: float) -> None:
    """One table of the padded-batch results with MFU/HFU against the best measured peak (updated in
    `result` too), and the end-to-end ratios."""
    print(f"\n{'case':5} {'model':18} {'tok/s':>8} {'MFU %':>6} {'HFU %':>6} {'ours/it':>8}")
    for key, rows in result.items():
        if not key.endswith("_padded") or not isinstance(rows, dict):
            continue
        case = key.removesuffix("_padded")
        for name, row in rows.items():
            row["mfu_pct"], row["hfu_pct"] = (
                round(row["mfu_pct"] * rescale, 1),
                round(row["hfu_pct"] * rescale, 1),
            )
            rel = ratios.get(f"{case}_padded_ours_vs_{name}", 1.0 if name == "ours" else float("nan"))
            mfu, hfu = row["mfu_pct"], row["hfu_pct"]
            print(f"{case:5} {name:18} {row['tok_s']:8.0f} {mfu:6.1f} {hfu:6.1f} {rel:8.2f}")
    for key, value in ratios.items():
        if "_e2e_" in key or key.startswith("rss_"):
            print(f"{key:60} {value:6.2f}")


def _rounded(table: dict[str, dict[str, float]], digits: int = 2) -> dict[str, dict[str, float]]:
    return {name: {k: round(v, digits) for k, v in row.items()} for name, row in table.items()}


def run_case(
    case: str,
    args: argparse.Namespace,
    names: list[str],
    revisions: dict[str, dict[str, ModuleType]],
    device: torch.device,
    peak: float,
) -> tuple[dict[str, object], dict[str, float]]:
    """Padded batches, profile and end to end for one model size; (JSON results, ratios)."""
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
    result: dict[str, object] = {}
    ratios: dict[str, float] = {}
    skip = set(filter(None, args.skip.split(",")))
    batches = make_batches(args.warmup + args.steps, args.batch_size, VOCAB, torch.Generator().manual_seed(0))
    batches = [batch.to(device) for batch in batches]
    if "padded" not in skip:
        times = interleaved(runners, {name: batches for name in runners}, args.warmup)
        rows = {name: summarize(runners[name], config, times[name], peak) for name in runners}
        result[f"{case}_padded"] = _rounded(rows)
        for name in rows:
            if name != "ours" and "ours" in rows:
                # per step, the same batch ran seconds apart: the median of these ratios shrugs off drift
                paired = [theirs / mine for (_, mine), (_, theirs) in zip(times["ours"], times[name])]
                ratios[f"{case}_padded_ours_vs_{name}"] = statistics.median(paired)
        _print_padded(case, rows, ratios, args.steps, args.batch_size)
    if "profile" not in skip and device.type == "cpu":
        splits = {name: profile_runner(r, batches[: args.profile_steps]) for name, r in runners.items()}
        _print_profile(case, splits, args.profile_steps)
        result[f"{case}_profile"] = _rounded(splits, 1)
    if "e2e" not in skip and case in args.e2e_cases.split(","):
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
        _print_e2e(case, rows, source, args.e2e_max_tokens, args.batch_size)
        result[f"{case}_e2e"] = {"lengths": source, **_rounded(rows)}
        for name in rows:
            if name != "ours bucketed" and "ours bucketed" in rows:
                key = f"{case}_e2e_ours_bucketed_vs_{name.replace(' ', '_')}"
                ratios[key] = rows["ours bucketed"]["tok_s"] / rows[name]["tok_s"]
    if args.compile or any(name.endswith(":compiled") for name in names):
        from torch._dynamo.utils import counters

        result[f"{case}_compile_counters"] = {
            key: dict(value) for key, value in counters.items() if key in ("stats", "recompiles")
        }
        print(f"[{case}] torch.compile counters: {result[f'{case}_compile_counters']}")
    return result, ratios


def main() -> None:
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
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        rss_child(args.rss_child, args.cases.split(",")[0], args.rss_steps, args.baseline)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, but torch.cuda.is_available() is False here")
    device = torch.device(args.device)
    args.bf16 = args.bf16 or device.type == "cuda"
    if not args.no_tune_malloc and device.type == "cpu":
        tune_malloc()
    if args.quick:
        args.steps, args.batch_size, args.e2e_sentences, args.rss_steps = 1, 16, 96, 1
    skip = set(filter(None, args.skip.split(",")))
    names = args.models.split(",") + ([f"ours@{args.baseline}"] if args.baseline else [])
    revisions = {args.baseline: load_revision(args.baseline)} if args.baseline else {}
    peak = _peak(device, args.bf16)
    load = os.getloadavg()
    where = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"torch {torch.__version__}, {where}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, malloc tuned: {not args.no_tune_malloc}, "
        f"{'bf16 autocast' if args.bf16 else 'fp32'}{', compiled' if args.compile else ''}, "
        f"load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}",
        flush=True,
    )
    result: dict[str, object] = {
        "benchmark": "bench_train",
        "torch": torch.__version__,
        "device": where,
        "threads": torch.get_num_threads(),
        "dtype": "bf16" if args.bf16 else "fp32",
        "load_start": load[0],
    }
    ratios: dict[str, float] = {}
    for case in args.cases.split(","):
        case_result, case_ratios = run_case(case, args, names, revisions, device, peak["peak"])
        result.update(case_result)
        ratios.update(case_ratios)

    if "rss" not in skip and device.type == "cpu":
        rss_case = "d256" if args.quick else "d512"
        rss = measure_rss(names, rss_case, args.rss_steps, args.baseline, torch.get_num_threads())
        print(f"\n[{rss_case}] peak RSS (VmHWM) over {args.rss_steps} training steps, one fresh process each")
        for name, row in rss.items():
            print(
                f"{name:18} after building {row['built_rss_mb']:7.0f} MB, peak {row['peak_rss_mb']:7.0f} MB"
            )
        result["rss_mb"] = {name: round(row["peak_rss_mb"]) for name, row in rss.items()}
        for name in rss:
            if name != "ours" and "ours" in rss:
                ratios[f"rss_ours_vs_{name}"] = rss["ours"]["peak_rss_mb"] / rss[name]["peak_rss_mb"]

    end_peak = _peak(device, args.bf16)  # the ceiling again: on a shared machine one look can be unlucky
    best = max(peak["peak"], end_peak["peak"])
    print(
        f"\nmatmul peak {best:.0f} GFLOP/s (start {peak['peak']:.0f}, end {end_peak['peak']:.0f}; "
        + ", ".join(f"{k} {v:.0f}" for k, v in peak.items() if k != "peak")
        + "); the tables above use the start value, the summary below the best"
    )
    result["peak_gflops"] = {"start": round(peak["peak"], 1), "end": round(end_peak["peak"], 1)}
    _print_summary(result, ratios, peak["peak"] / best)
    result["load_end"] = os.getloadavg()[0]
    result["ratios"] = {key: round(value, 3) for key, value in ratios.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
