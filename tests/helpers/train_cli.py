"""train.py's quickstart shrunk to a tiny run (TINY), and train.py run from its command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import forkserver
from tests.conftest import REPO_ROOT, cli_env

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
IN_PROCESS = ["tune_malloc=false"]  # leave the test process's allocator alone


def train_cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`python train.py ARGS...` in `cwd` as a user runs it, with `env` added to its environment."""
    return forkserver.run(
        [sys.executable, str(REPO_ROOT / "train.py"), *args], cwd=cwd, env=cli_env(**env), timeout=600
    )
