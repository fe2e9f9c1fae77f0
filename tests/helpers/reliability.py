"""What the reliability tests (interrupted runs, atomic checkpoints, non-finite losses, hostile input) share:
the tiny train.py run they start, interrupt and read (its arguments, the run itself, its logged curves, its
checkpoint, its error line), and a toy LightningModule fitted in-process.

The test-only hooks that the CLI runs load by `_target_` are in tests/helpers/callbacks.py (HOOK).
"""

from __future__ import annotations

import csv
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from tests.helpers.cli import TINY, run_script
from transformer.training.callbacks import NonFiniteLossGuard

# The tiny quickstart of tests/helpers/cli.py (600 examples = 10 steps per epoch), 5 epochs, no test, no
# selection metric
RUN = [
    *(o for o in TINY if not o.startswith("trainer.max_epochs=")),
    "optimized_metric=null",
    "test=false",
    "trainer.max_epochs=5",
]
EXACT = ["trainer.deterministic=true"]
EVERY_STEP = [
    "callbacks.last_checkpoint.every_n_train_steps=1",
    "callbacks.last_checkpoint.every_n_epochs=null",
]
HOOK = "tests.helpers.callbacks"


def train_args(run_dir: Path, args: list[str]) -> list[str]:
    """train.py's arguments for RUN in `run_dir` with `args` added."""
    other_data = any(arg.startswith("experiment=") for arg in args)  # no synthetic sizes to set there
    base = [a for a in RUN if not (other_data and a.startswith("data.synthetic_sizes"))]
    return [*base, f"hydra.run.dir={run_dir}", *args]


def train_in(run_dir: Path, args: list[str], **run: Any) -> subprocess.CompletedProcess[str]:
    """`python train.py` of RUN in `run_dir` with `args` (`run`: `on_start`, as run_script takes it)."""
    return run_script("train.py", train_args(run_dir, args), cwd=run_dir.parent, timeout=600, **run)


def train_parallel(jobs: dict[str, tuple[Path, list[str]]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """name -> (run_dir, args): the runs two at a time."""
    with ThreadPoolExecutor(max_workers=2) as pool:  # each run is mostly interpreter start-up
        futures = {name: pool.submit(train_in, run_dir, args) for name, (run_dir, args) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def logged_curves(run_dir: Path, once: bool = True) -> dict[tuple[str, int], float]:
    """(metric, step) -> value for the per-step training loss and learning rate, and the validation
    loss and BLEU, in the CSV log (the last value where, with gradient accumulation, `once=False`
    allows several rows per optimizer step)."""
    curves = {}
    with (run_dir / "csv" / "metrics.csv").open() as f:
        for row in csv.DictReader(f):
            for name in ("train/loss", "lr-AdamW/pg1", "train/skipped_steps", "val/loss", "val/bleu"):
                if row.get(name):
                    key = (name, int(row["step"]))
                    assert not once or key not in curves, f"{key} logged twice"
                    curves[key] = float(row[name])
    return curves


def load_checkpoint(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else ""


# --- a toy LightningModule fitted in-process -------------------------------------------------------------


def toy_schedule(step: int) -> float:
    """The toy's learning-rate schedule: a factor that changes at every optimizer step."""
    return 1.0 / (1.0 + step)


class Toy(L.LightningModule):
    """One linear layer under AdamW and a per-step schedule; the loss is NaN at the optimizer steps in
    `nan_steps` (1-based). After every batch it records the weights, every optimizer state tensor
    (exp_avg, exp_avg_sq, step), the learning rate and the global step. `fused`: the fused AdamW kernel,
    which the guard makes skip a step on the device (no read per step); otherwise the guard reads."""

    def __init__(self, nan_steps: set[int], fused: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.nan_steps = nan_steps
        self.fused = fused
        self.history: list[dict[str, Any]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        return loss * float("nan") if self.global_step + 1 in self.nan_steps else loss

    def on_train_batch_end(self, *args: Any) -> None:
        optimizer = self.optimizers().optimizer
        moments = {
            f"{name}.{key}": value.clone()
            for name, param in self.named_parameters()
            for key, value in optimizer.state.get(param, {}).items()
        }
        self.history.append(
            {
                "weights": {k: v.clone() for k, v in self.state_dict().items()},
                "optimizer": moments,
                "lr": optimizer.param_groups[0]["lr"],
                "global_step": self.global_step,
            }
        )

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1, fused=self.fused)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, toy_schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=1)


def fit_toy(
    guard: NonFiniteLossGuard,
    nan_steps: set[int],
    tmp_path: Path,
    model: Toy | None = None,
    callbacks: list[L.Callback] = (),
) -> Toy:
    model = model or Toy(nan_steps)
    trainer = L.Trainer(
        max_steps=8,
        callbacks=[guard, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
    )
    trainer.fit(model)
    return model
