"""Runs many `python train.py ...` / `python evaluate.py ...` commands in one interpreter, in order.

    python -m tests.integration.readme_driver PLAN.json RESULTS.json

PLAN is a list of {"script", "args", "stdin", "subprocess"}; RESULTS gets, for each, the exit status
and the output. Each command runs as `python SCRIPT ARGS` would (`runpy` as `__main__`), so the
libraries are imported once for all of them; "subprocess": true runs one as a real process instead
(DDP, which starts its workers by re-running the command line).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import torch


def _run_here(script: str, args: list[str], stdin: str) -> tuple[int, str]:
    output = io.StringIO()
    sys.argv = [script, *args]
    saved_stdin, threads = sys.stdin, torch.get_num_threads()
    sys.stdin = io.StringIO(stdin)
    status = 0
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exit_:
                if isinstance(exit_.code, str):
                    print(exit_.code, file=sys.stderr)  # what Python prints for SystemExit("error: ...")
                    status = 1
                else:
                    status = exit_.code or 0
            except BaseException:
                import traceback

                traceback.print_exc()
                status = 1
    finally:
        sys.stdin = saved_stdin
        torch.set_num_threads(threads)  # a command's num_threads=1 must not slow the next ones
    return status, output.getvalue()


def _run_process(script: str, args: list[str], stdin: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, script, *args], input=stdin, capture_output=True, text=True, timeout=900
    )
    return done.returncode, done.stdout + done.stderr


def main() -> None:
    plan_file, results_file = Path(sys.argv[1]), Path(sys.argv[2])  # each command replaces sys.argv
    plan = json.loads(plan_file.read_text())
    results = []
    for step in plan:
        start = time.perf_counter()
        run = _run_process if step.get("subprocess") else _run_here
        status, output = run(step["script"], step["args"], step.get("stdin") or "")
        results.append({"status": status, "output": output, "seconds": time.perf_counter() - start})
        print(f"[{status}] {time.perf_counter() - start:6.1f}s {' '.join(step['args'])}", file=sys.__stderr__)
        results_file.write_text(json.dumps(results))  # what is done so far, if a later one hangs


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    main()
