"""bench_gpu.py's training part: the FLOPs that MFU counts, and one competitor's run (warm-up with compiling,
timed steps, peak memory), failures reported. Its batches: `benchmarks.common.shapes.wmt_batches`.
"""

from __future__ import annotations

import gc
import math
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks.common.references import Batch
from benchmarks.train.runners import build_runner
from transformer.config import TransformerConfig

FLOPS_FORMULA = (
    "6 x matmul parameters x non-pad tokens (source tokens: encoder layers + the decoder's cross-attention "
    "K/V; target tokens: decoder layers + the tied output projection; embedding lookups 0 FLOPs) + "
    "12 x d_model x (enc layers x sum S^2 + dec layers x sum (T^2 + T x S)) over each sentence's own "
    "non-pad lengths (attention scores and weighted sums, full squares); biases and norms not counted; "
    "the same useful FLOPs for every model"
)


def train_flops(config: TransformerConfig, batch: Batch) -> float:
    """The useful FLOPs of one training step on `batch` (FLOPS_FORMULA)."""
    D, F_, V = config.d_model, config.d_ff, config.tgt_vocab_size
    src_len = batch.src.ne(0).sum(1).double()  # (B,)
    tgt_len = batch.tgt_out.ne(0).sum(1).double()  # (B,)
    enc = config.n_encoder_layers * (4 * D * D + 2 * D * F_)
    dec = config.n_decoder_layers * (4 * D * D + 2 * D * D + 2 * D * F_)
    memory = config.n_decoder_layers * 2 * D * D
    params = (enc + memory) * src_len.sum() + (dec + D * V) * tgt_len.sum()
    attention = (
        config.n_encoder_layers * (src_len**2).sum()
        + config.n_decoder_layers * (tgt_len**2 + tgt_len * src_len).sum()
    )
    return float(6 * params + 12 * D * attention)


_DEADLINES: list[float] = []  # the enclosing time limits' deadlines (time.monotonic()), innermost last


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise TimeoutError in the main thread after `seconds` (SIGALRM; None or 0: no limit of its own).

    Limits nest: an inner one never outlives the one around it (bench_gpu.py's time box of a case around
    a compile timeout), and leaving it re-arms the outer one with what is left of it."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return
    start = time.monotonic()
    outer = _DEADLINES[-1] if _DEADLINES else math.inf
    deadline = min(outer, start + seconds) if seconds else outer

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"did not finish within {deadline - start:.3g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    _DEADLINES.append(deadline)
    if deadline < math.inf:
        signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _DEADLINES.pop()
        signal.signal(signal.SIGALRM, previous)
        if _DEADLINES and _DEADLINES[-1] < math.inf:  # the outer limit runs on (or expires now)
            signal.setitimer(signal.ITIMER_REAL, max(_DEADLINES[-1] - time.monotonic(), 1e-3))


def _compiles(name: str) -> bool:
    """ours:compiled, ours:compiled-layers, torch:compiled: a case that compiles (under the timeout)."""
    return name.partition(":")[2] in ("compiled", "compiled-layers")


def build(name: str, config: TransformerConfig, device: torch.device, backend: str) -> Any:
    """ours | ours:compiled | ours:compiled-layers | torch | torch:no-cudnn | torch:compiled | marian (or any
    of bench_train's `ours:VARIANT`), as bench_train builds them, on `device`. Compiled: ours as
    `model.compile=true` compiles the training step (forward and loss, dynamic shapes,
    `transformer.training.compiling`) or `model.compile=layers` its encoder and decoder layers
    (`transformer.stacks.compile_layers`); the references with `torch.compile(dynamic=True)` (bucketed
    batches change shape every step) on the model."""
    base, _, variant = name.partition(":")
    if variant == "compiled" and base != "ours":  # ours:compiled compiles its step as the task does
        name = base
    runner = build_runner(name, config, {}, device, compile_backend=backend)
    runner.model.to(device).train()
    if variant == "compiled" and base != "ours":
        runner.model.compile(dynamic=True, backend=backend)
    return runner


def run_training_case(
    name: str, config: TransformerConfig, batches: list[Batch], args: Any, device: torch.device
) -> dict[str, Any]:
    """Warm-up steps (compiling, if any, under `args.compile_timeout`), then timed steps; a failure is
    returned as {"error": ...}, never raised. tok/s and MFU are over all timed steps, so a recompilation
    among them counts against the model; `frames_compiled` counts what Dynamo compiled (graph breaks and
    recompilations each add one)."""
    from torch._dynamo.utils import counters

    counters.clear()
    runner = None
    row: dict[str, Any] = {}
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        runner = build(name, config, device, args.compile_backend)
        runner.autocast = torch.bfloat16 if args.bf16 else None
        compiled = _compiles(name)
        with time_limit(args.compile_timeout if compiled else None):
            warm = [runner.step(batch) for batch in batches[: args.warmup]]
        frames_warm = counters["frames"]["total"]
        steps = [(batch, runner.step(batch)) for batch in batches[args.warmup :]]
        row = _summary(config, steps, args.peak_tflops)
        if compiled:  # every step's time beyond the median timed step: compiling (also a late recompile)
            row["compile_s"] = sum(warm) + sum(s for _, s in steps) - (len(warm) + len(steps)) * row["step_s"]
            row["frames_compiled"] = counters["frames"]["total"]  # 1 = one graph, never recompiled
            row["frames_compiled_in_timed_steps"] = counters["frames"]["total"] - frames_warm
        if device.type == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as error:  # reported in the table; the other cases still run
        row = {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"}
    finally:
        del runner
        gc.collect()
        if _compiles(name):
            torch._dynamo.reset()
    return row


def _summary(config: TransformerConfig, steps: list[tuple[Batch, float]], peak_tflops: float | None) -> dict:
    """Non-pad tokens/s and MFU over all timed steps (totals, not medians: batches differ in size)."""
    seconds = sum(s for _, s in steps)
    tokens = sum(batch.n_tokens for batch, _ in steps)
    flops = sum(train_flops(config, batch) for batch, _ in steps)
    return {
        "tok_s": tokens / seconds,
        "step_s": statistics.median(s for _, s in steps),
        "tokens_per_batch": tokens / len(steps),
        "pad_pct": 100 * statistics.mean(batch.pad_fraction for batch, _ in steps),
        "tflops": flops / seconds / 1e12,
        "mfu_pct": 100 * flops / seconds / 1e12 / peak_tflops if peak_tflops else None,
    }
