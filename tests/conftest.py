"""Shared fixtures: seeded RNG, paths to the real datasets, GPU skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# The tests that need a real dataset find it through these variables (unset: skipped, saying how to run them).
DATASETS = {
    "MULTI30K_DIR": (
        "/path/to/multi30k",
        "the official data/task1/raw layout: train.de.gz, train.en.gz, ...",
    ),
    "SST2_DIR": ("/path/to/SST-2", "the GLUE layout: train.tsv[.gz], dev.tsv"),
}


def _data_dir(env: str) -> Path:
    value = os.environ.get(env)
    if not value:
        example, layout = DATASETS[env]
        pytest.skip(f"needs the real data: run `{env}={example} pytest` ({layout}); .ci/run sets it")
    path = Path(value)
    if not path.is_dir():
        pytest.fail(f"{env}={value} is not a directory")
    return path


@pytest.fixture
def multi30k_dir() -> Path:
    """The Multi30k `data/task1/raw` directory from $MULTI30K_DIR."""
    return _data_dir("MULTI30K_DIR")


@pytest.fixture
def sst2_dir() -> Path:
    """The SST-2 GLUE directory from $SST2_DIR."""
    return _data_dir("SST2_DIR")
