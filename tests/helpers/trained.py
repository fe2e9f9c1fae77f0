"""One tiny training run per task, made once per test process (session fixtures) and shared by every test
that only reads a trained checkpoint: `translation_run` (the quickstart shrunk) and `classification_run`
(SST-2-like). A test module requests them with `from tests.helpers.trained import translation_run`; no
test may write into their directories (evaluate.py writes its results elsewhere)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.cli import run_script
from tests.helpers.repo import REPO_ROOT
from tests.helpers.sst import TINY_SST, write_sst

# The quickstart experiment, shrunk: a few dozen steps of a tiny model. Decoding is capped at
# source length + 2 tokens (saved in the checkpoint, so evaluation decodes the same way).
TINY_QUICKSTART = [
    "data.synthetic_sizes.train=600",
    "data.synthetic_sizes.val=30",
    "data.synthetic_sizes.test=40",
    "model.config.d_model=32",
    "model.config.n_heads=2",
    "model.config.d_ff=64",
    "model.optimizer.lr=3e-3",
    "model.scheduler.warmup_steps=20",
    "model.decoding.max_len_a=1.0",
    "model.decoding.max_len_b=2",
    "trainer.max_epochs=3",
    "trainer.num_sanity_val_steps=0",
    "callbacks.model_checkpoint.save_top_k=-1",  # every epoch's checkpoint, for average_last
]
TEST_SENTENCES = 40  # the test split of TINY_QUICKSTART


def train_run(run_dir: Path, cache: Path, overrides: list[str], trainer: str = "cpu") -> Path:
    """A training run through the CLI. On the CPU by default, also on a GPU machine: evaluate.py scores on
    the CPU, and the tests compare its numbers with the run's own test step exactly."""
    env = {**os.environ, "PROJECT_ROOT": str(REPO_ROOT), "WANDB_MODE": "offline"}
    args = [f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache}", "logger=csv", f"trainer={trainer}"]
    result = run_script("train.py", [*args, *overrides], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def translation_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of TINY_QUICKSTART: checkpoints/epoch_00{0,1,2}.ckpt, last.ckpt, metrics.json."""
    root = tmp_path_factory.mktemp("quickstart")
    return train_run(root / "run", root / "cache", TINY_QUICKSTART)


@pytest.fixture(scope="session")
def classification_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SST-2 run (max pooling, token dropout, EMA weights in its checkpoints); its data in ../data."""
    root = tmp_path_factory.mktemp("sst")
    data = write_sst(root / "data")
    return train_run(
        root / "run",
        root / "cache",
        [
            "data=sst2",
            "model=classification",
            f"data.data_dir={data}",
            *TINY_SST,
            "model.pooling=max",
            "model.token_dropout=0.1",
            "callbacks=[default,ema]",  # checkpoints hold the averaged weights
            "callbacks.ema.decay=0.9",
            "callbacks.model_checkpoint.monitor=val/acc",
            "optimized_metric=val/acc_best",
        ],
    )
