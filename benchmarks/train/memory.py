"""Memory of bench_train.py: glibc's malloc tuned as train.py tunes it, and the peak RSS of a model's
training steps, each model in a fresh process (`python -m benchmarks.train.bench_train --rss-child NAME`)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import torch

from benchmarks.common.references import REPO, load_revision, make_batches
from benchmarks.train.runners import CASES, VOCAB, build_runner
from transformer.config import TransformerConfig


def tune_malloc() -> None:
    """glibc: no mmap / no trim for large buffers, as train.py's `tune_malloc: true` (shared/PERF.md)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD


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
    """Each model's RSS after building and at its peak, from a fresh `--rss-child` process each."""
    results = {}
    for name in names:
        command = [sys.executable, "-m", "benchmarks.train.bench_train", "--rss-child", name, "--cases", case]
        command += ["--threads", str(threads), "--rss-steps", str(steps)]
        command += ["--baseline", baseline] if baseline else []
        out = subprocess.run(
            command,
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
        )
        if out.returncode:
            raise RuntimeError(f"RSS subprocess for {name} failed:\n{out.stderr[-2000:]}")
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return results
