"""python -m benchmarks.gpu.bench_gpu --smoke: the one-call GPU benchmark's whole code path on the CPU
(tiny shapes, fp32), so that it still runs when a GPU is at hand. A competitor that fails is reported, not
raised."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import forkserver
from tests.helpers.cli import run_script

pytestmark = pytest.mark.slow


def test_bench_gpu_smoke_runs_every_case_and_reports_failures(tmp_path: Path) -> None:
    # nosuch: a case that fails
    models = "ours,ours:compiled,torch,torch:no-cudnn,torch:compiled,marian,nosuch"
    done = run_script(
        "benchmarks.gpu.bench_gpu",
        ["--smoke", "--models", models, "--results-dir", str(tmp_path)],
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("{"))
    (written,) = tmp_path.glob("*_cpu_smoke_bench_gpu.txt")  # the table and the JSON line, as printed
    assert written.read_text().splitlines()[-1] == line and "Training, 2 timed steps" in written.read_text()
    result = json.loads(line)
    train = result["train"]
    assert "unknown model 'nosuch'" in train.pop("nosuch")["error"]
    assert "nosuch" in done.stdout and "failed: ValueError" in done.stdout  # in the table, not a traceback
    for name, row in train.items():
        if "error" in row:  # a model that does not compile may fail; the others must have run
            assert name.endswith(":compiled"), (name, row)
            continue
        assert row["tok_s"] > 0 and row["tokens_per_batch"] > 0 and row["mfu_pct"] is None  # no peak on a CPU
        assert (row.get("frames_compiled", 0) >= 1) == name.endswith(":compiled")
    assert "tok_s" in train["ours"] and "tok_s" in train["torch"] and "tok_s" in train["marian"]
    for size in (4, 8):
        for mode in ("beam4", "greedy"):
            rows = result["decode"][f"batch{size}_{mode}"]
            for name in ("ours", "transformers generate", *(["ctranslate2"] * ("ctranslate2" in rows))):
                # the same fixed work for every decoder: 5 tokens per sentence
                assert rows[name]["sent_s"] > 0 and rows[name]["mean_length"] == 5.0, (size, mode, name)
    assert "tok_s" in train["torch:no-cudnn"]  # torch with the SDPA backends ours uses
    assert result["ratios"]["train_ours_vs_torch_eager"] > 0
    assert result["ratios"]["train_ours_vs_torch_eager_no_cudnn"] > 0
    checks = {(c["target"], c["by"]): c["met"] for c in result["target_checks"]}  # each target, met or not
    assert {"training x torch", "training x torch:no-cudnn"} <= {target for target, _ in checks}
    assert ("beam4 x generate", "ours") in checks and ("greedy x generate", "ours") in checks
    assert "Targets (the best measured for each" in done.stdout


def test_bench_gpu_budget_reports_the_cases_it_did_not_reach(tmp_path: Path) -> None:
    """Cases in value order under --budget-s; those past it are in the table and the JSON as skipped."""
    done = run_script(
        "benchmarks.gpu.bench_gpu",
        ["--smoke", "--budget-s", "0", "--results-dir", str(tmp_path)],
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert all("skipped" in row for row in result["train"].values())
    assert set(result["decode"]) == {"batch4_beam4", "batch4_greedy", "batch8_beam4", "batch8_greedy"}
    assert re.search(r"^ours +skipped: the time budget \(--budget-s 0\) was spent", done.stdout, re.M)


def test_bench_gpu_leaves_every_finished_row_when_it_is_killed(tmp_path: Path) -> None:
    """The results file grows row by row: a run killed (a time limit) keeps what it measured."""
    args = ["--smoke", "--models", "ours,torch", "--results-dir", str(tmp_path)]
    bench = forkserver.in_a_thread(run_script, "benchmarks.gpu.bench_gpu", args, timeout=600)
    with bench as (pid, run):
        try:
            deadline = time.monotonic() + 300
            rows: list[str] = []
            while time.monotonic() < deadline and not run.done():
                text = "".join(p.read_text() for p in tmp_path.glob("*_bench_gpu.txt"))
                rows = [line for line in text.splitlines() if line.startswith("torch ")]
                if rows:
                    break
                time.sleep(0.2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.result()
    assert rows, "the torch row never appeared in the results file"
    (written,) = tmp_path.glob("*_cpu_smoke_bench_gpu.txt")
    text = written.read_text()
    assert text.startswith("$ python -m benchmarks.gpu.bench_gpu --smoke") and "\nours " in text
