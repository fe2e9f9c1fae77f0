"""The one way tests run an entry point as a user does: `run_script` (`python SCRIPT ARGS` or `python -m
MODULE ARGS`, forked from the warm interpreter of tests/helpers/forkserver.py); and TINY, train.py's
quickstart shrunk to a tiny run. (Many commands in one interpreter: tests/helpers/driver.py.)"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.helpers import forkserver
from tests.helpers.repo import REPO_ROOT, cli_env

# The quickstart shrunk to a few dozen steps of a tiny model (seconds, not minutes).
TINY = [
    "data.synthetic_sizes.train=600",
    "data.synthetic_sizes.val=30",
    "data.synthetic_sizes.test=30",
    "data.vocab_size=300",
    "model.config.d_model=32",
    "model.config.n_heads=2",
    "model.config.n_encoder_layers=1",
    "model.config.n_decoder_layers=1",
    "model.config.d_ff=64",
    "model.optimizer.lr=3e-3",
    "model.scheduler.warmup_steps=8",
    "model.decoding.max_len_b=4",
    "trainer.max_epochs=2",
    "trainer.log_every_n_steps=1",
    "trainer.num_sanity_val_steps=0",
    "++trainer.enable_progress_bar=false",
    "callbacks.rich_progress_bar=null",
    "callbacks.model_summary=null",
]
IN_PROCESS = ["tune_malloc=false"]  # train(cfg) in the test process: leave its allocator alone


def run_script(
    script: str | Path,
    args: list[str],
    *,
    cwd: Path = REPO_ROOT,
    stdin: str | None = None,
    timeout: float = 900,
    env: dict[str, str] | None = None,
    fresh: bool = False,
    on_start: Callable[[int], object] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python SCRIPT ARGS...` as a user runs it: SCRIPT a file of the repository (`train.py`) or any path; a
    dotted name without `.py` (`benchmarks.gpu.bench_gpu`) runs as `python -m SCRIPT ARGS...`. Forked from
    the warm interpreter of tests/helpers/forkserver.py, or with `fresh` a new interpreter; `env` (default:
    `cli_env()`) is the whole environment; `on_start(pid)` is called once the process exists."""
    name = str(script)
    module = isinstance(script, str) and not name.endswith(".py") and "/" not in name
    command = ["-m", name] if module else [str(REPO_ROOT / script)]
    return forkserver.run(
        [sys.executable, *command, *args],
        input=stdin,
        cwd=cwd,
        env=cli_env() if env is None else env,
        timeout=timeout,
        on_start=on_start,
        fresh=fresh,
    )
