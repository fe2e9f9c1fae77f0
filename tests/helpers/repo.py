"""The repository the tests run in (REPO_ROOT) and the environment its entry points run with (cli_env)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def cli_env(**env: str) -> dict[str, str]:
    """The environment of a command-line run: no inherited wandb settings, unbuffered, one-line errors."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    environ.update(PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0", **env)
    environ.pop("PROJECT_ROOT", None)  # the entry points find the repository themselves
    return environ
