"""The real datasets some tests need, found through environment variables (unset: the test is skipped,
saying how to run it). The fixtures `multi30k_dir` and `sst2_dir` (tests/conftest.py) use `data_dir`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# variable -> (an example value, the layout the directory must have)
DATASETS = {
    "MULTI30K_DIR": (
        "/path/to/multi30k",
        "the official data/task1/raw layout: train.de.gz, train.en.gz, ...",
    ),
    "SST2_DIR": ("/path/to/SST-2", "the GLUE layout: train.tsv[.gz], dev.tsv"),
}


def data_dir(env: str) -> Path:
    """The directory in $`env`; skips the test when unset, fails it when not a directory."""
    value = os.environ.get(env)
    if not value:
        example, layout = DATASETS[env]
        pytest.skip(f"needs the real data: run `{env}={example} pytest` ({layout}); .ci/run sets it")
    path = Path(value)
    if not path.is_dir():
        pytest.fail(f"{env}={value} is not a directory")
    return path
