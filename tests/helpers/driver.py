"""Runs many `python SCRIPT ARGS` commands in one interpreter, in order: the libraries are imported once.

    python -m tests.helpers.driver PLAN.json RESULTS.json

PLAN is a list of {"script", "args", "stdin", "cwd", "subprocess"}; RESULTS gets, for each, the exit status,
stdout, stderr and seconds, written after each command (what is done so far, if a later one hangs). Each
command runs as `python SCRIPT ARGS` would (`runpy` as `__main__`, its own working directory, environment
and stdin; `SystemExit("error: ...")` printed as Python prints it; an escaping exception's traceback
printed). "subprocess": true runs one as a real process instead (DDP, which starts its workers by re-running
the command line). Tests call `run_in_one_interpreter`; the one-line/no-traceback contract of a real
process is checked once per entry point by tests that start one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests.helpers import forkserver
from tests.helpers.forkserver import exit_status
from tests.helpers.repo import REPO_ROOT, cli_env


def _run_here(script: str, args: list[str], stdin: str, cwd: str | None) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv = [script, *args]
    saved_stdin, saved_cwd, saved_env = sys.stdin, os.getcwd(), dict(os.environ)
    threads = torch.get_num_threads()
    sys.stdin = io.StringIO(stdin)
    status = 0
    try:
        if cwd:
            os.chdir(cwd)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exit_:
                status = exit_status(exit_)
            except BaseException:
                import traceback

                traceback.print_exc()
                status = 1
    finally:
        sys.stdin = saved_stdin
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)  # a command's num_threads=1 must not slow the next ones
    return status, stdout.getvalue(), stderr.getvalue()


def _run_process(script: str, args: list[str], stdin: str, cwd: str | None) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, script, *args], input=stdin, capture_output=True, text=True, timeout=900, cwd=cwd
    )
    return done.returncode, done.stdout, done.stderr


def run_in_one_interpreter(
    steps: list[dict[str, Any]], *, timeout: float = 900, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Each step ({"script", "args", "stdin", "cwd", "subprocess"}) as a `CompletedProcess`, run in order
    in one interpreter forked from tests/helpers/forkserver.py's warm one (the repository root its working
    directory unless "cwd" says otherwise)."""
    steps = [{**step, "script": str(REPO_ROOT / step["script"])} for step in steps]
    with tempfile.TemporaryDirectory(prefix="driver_") as tmp:
        plan, out = Path(tmp) / "plan.json", Path(tmp) / "results.json"
        plan.write_text(json.dumps(steps))
        done = forkserver.run(  # forked from the test process's warm interpreter
            [sys.executable, "-m", "tests.helpers.driver", str(plan), str(out)],
            cwd=REPO_ROOT,
            env=cli_env() if env is None else env,
            timeout=timeout,
        )
        ran = json.loads(out.read_text()) if out.is_file() else []
    stopped = f"the driver stopped after {len(ran)} of {len(steps)}: {done.stderr[-3000:]}"
    assert len(ran) == len(steps), stopped
    return [
        subprocess.CompletedProcess([step["script"], *step["args"]], r["status"], r["stdout"], r["stderr"])
        for step, r in zip(steps, ran, strict=True)
    ]


def main() -> None:
    plan_file, results_file = Path(sys.argv[1]), Path(sys.argv[2])  # each command replaces sys.argv
    plan = json.loads(plan_file.read_text())
    results = []
    for step in plan:
        start = time.perf_counter()
        run = _run_process if step.get("subprocess") else _run_here
        status, stdout, stderr = run(step["script"], step["args"], step.get("stdin") or "", step.get("cwd"))
        seconds = time.perf_counter() - start
        results.append({"status": status, "stdout": stdout, "stderr": stderr, "seconds": seconds})
        print(f"[{status}] {seconds:6.1f}s {' '.join(step['args'])}", file=sys.__stderr__)
        results_file.write_text(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    main()
