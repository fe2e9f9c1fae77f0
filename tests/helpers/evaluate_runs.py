"""What the evaluate.py tests (scores, translating text, bad input) share: evaluate.py or train.py run in the
repository with the environment of this process, a run's metrics.json and best checkpoint, the scores that
must be equal or close, and `compose_eval`, a fixture composing configs/eval.yaml for `evaluate(cfg)` in this
process."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from tests.helpers.cli import run_script
from tests.helpers.repo import REPO_ROOT

EXACT = ("test/bleu", "test/chrf", "test/exact_match")
CLOSE = ("test/loss", "test/nll", "test/ppl", "test/token_acc")


def run_in_project(
    script: str, args: list[str], stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`python SCRIPT ARGS` with this process's environment, PROJECT_ROOT set and wandb offline."""
    env = {**os.environ, "PROJECT_ROOT": str(REPO_ROOT), "WANDB_MODE": "offline"}
    return run_script(script, args, stdin=stdin, env=env)


def read_metrics(directory: Path) -> dict:
    """The run's (or evaluation's) metrics.json."""
    return json.loads((directory / "metrics.json").read_text())


def best_checkpoint(run: Path) -> Path:
    """The run's best checkpoint, as its metrics.json names it."""
    return Path(read_metrics(run)["best_ckpt_path"])


@pytest.fixture
def compose_eval(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """`evaluate(cfg)` in this process (no interpreter start-up): compose configs/eval.yaml with overrides."""
    monkeypatch.setenv("PROJECT_ROOT", str(REPO_ROOT))

    def make(out_dir: Path, *overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
            return compose("eval", overrides=[f"paths.output_dir={out_dir}", "progress=false", *overrides])

    yield make
