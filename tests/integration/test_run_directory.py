"""Short runs and reused run directories through the real command line: a run that ends before its first
validation exits 0; a requeued identical command continues its run directory at the right step, exactly;
a run never trains over, or tests over, an earlier run's files."""

from __future__ import annotations

import csv
import hashlib
import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import TINY, run_script
from transformer.training.loggers import CSVLogger
from transformer.training.run_directory import RunDirectoryError, checkpoint_to_continue

HOOK = "tests.helpers.callbacks"
# 600 examples = 10 steps per epoch; deterministic so that a continued run can equal a straight one
RUN = [
    *(o for o in TINY if not o.startswith("trainer.max_epochs=")),
    "trainer.deterministic=true",
    "test=false",
]


def _cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_script("train.py", [*RUN, f"hydra.run.dir={run_dir}", *args], cwd=run_dir.parent, timeout=600)


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def _losses(run_dir: Path) -> dict[int, float]:
    losses: dict[int, float] = {}
    for row in _rows(run_dir):
        if row.get("train/loss"):
            step = int(row["step"])
            assert step not in losses, f"step {step} logged twice"
            losses[step] = float(row["train/loss"])
    return losses


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "train.log" and ".hydra" not in p.parts
    }


# --- the rule, on plain directories (fast) -----------------------------------------------------------


def test_checkpoint_to_continue(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert checkpoint_to_continue(run, None, train=True) is None  # a new directory
    (run / "checkpoints").mkdir(parents=True)
    (run / "csv").mkdir()
    (run / "csv" / "metrics.csv").write_text("step\n1\n")
    assert checkpoint_to_continue(run, None, train=True) is None  # logs only: nothing to continue
    (run / "checkpoints" / "epoch_001.ckpt").write_bytes(b"")
    with pytest.raises(
        RunDirectoryError, match=r"epoch_001\.ckpt.*from scratch.*ckpt_path=.*epoch_001\.ckpt"
    ):
        checkpoint_to_continue(run, None, train=True)
    elsewhere = tmp_path / "other.ckpt"
    with pytest.raises(RunDirectoryError, match="from ckpt_path="):
        checkpoint_to_continue(run, str(elsewhere), train=True)
    own = str(run / "checkpoints" / "epoch_001.ckpt")
    assert checkpoint_to_continue(run, own, train=True) == own  # continuing one of its own: allowed
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert checkpoint_to_continue(run, None, train=True) == str(run / "checkpoints" / "last.ckpt")
    assert checkpoint_to_continue(run, None, train=False) is None  # test-only: no results yet
    (run / "metrics.json").write_text("{}")
    with pytest.raises(RunDirectoryError, match=r"metrics\.json.*test-only"):
        checkpoint_to_continue(run, own, train=False)


def test_csv_logger_keeps_the_rows_before_the_continued_steps(tmp_path: Path) -> None:
    earlier = CSVLogger(tmp_path, name="csv", version="")
    for step in (1, 2, 3, 4):
        earlier.log_metrics({"train/loss": float(step)}, step=step)
    earlier.log_metrics({"val/bleu": 9.0}, step=4)
    earlier.save()
    continued = CSVLogger(tmp_path, name="csv", version="")  # continues from a checkpoint at step 2
    continued.log_metrics({"train/loss": 30.0, "lr": 0.5}, step=3)
    continued.save()
    rows = _rows(tmp_path)
    assert [(r["step"], r["train/loss"], r["val/bleu"], r["lr"]) for r in rows] == [
        ("1", "1.0", "", ""),
        ("2", "2.0", "", ""),
        ("3", "30.0", "", "0.5"),
    ]


# --- the command line (slow) -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_that_ends_before_validating_exits_0(tmp_path: Path) -> None:
    done = _cli(tmp_path / "short", "trainer.max_steps=3", "test=true")
    assert done.returncode == 0, done.stderr[-3000:]
    log = (tmp_path / "short" / "train.log").read_text()
    assert (
        "No validation ran before training ended at step 3, so optimized_metric=val/bleu_best has no value"
        in log
    )
    metrics = json.loads((tmp_path / "short" / "metrics.json").read_text())
    assert metrics["global_step"] == 3 and "val/bleu_best" not in metrics and "test/bleu" in metrics


@pytest.mark.slow
def test_a_requeued_command_continues_its_run_exactly(tmp_path: Path) -> None:
    """16 steps straight == the same command stopped by SIGTERM after step 7 and run again as it was: the
    second run continues from the directory's last.ckpt, every step logged once, the same losses and
    bitwise the same weights; a third run of the finished command trains no further."""
    straight, requeued = tmp_path / "straight", tmp_path / "requeued"
    assert _cli(straight, "trainer.max_steps=16").returncode == 0
    term = [f"+callbacks.sigterm._target_={HOOK}.SignalAtStep", "+callbacks.sigterm.step=6"]
    command = ["trainer.max_steps=16", *term, "+callbacks.sigterm.signal=SIGTERM"]
    first = _cli(requeued, *command)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
    assert sorted(_losses(requeued)) == list(range(7))  # CSV steps count from 0
    second = _cli(requeued, *command)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (
        f"Continuing the earlier run in {requeued} from {requeued}/checkpoints/last.ckpt"
        in (requeued / "train.log").read_text()
    )
    assert _losses(requeued) == _losses(straight) and sorted(_losses(straight)) == list(range(16))
    weights = [
        torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        for d in (straight, requeued)
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    metrics = json.loads((requeued / "metrics.json").read_text())
    assert metrics["global_step"] == 16

    third = _cli(requeued, *command)  # finished: continues from step 16, nothing left to train
    assert third.returncode == 0, third.stderr[-3000:]
    assert json.loads((requeued / "metrics.json").read_text())["global_step"] == 16
    assert _losses(requeued) == _losses(straight)


@pytest.mark.slow
def test_a_run_never_overwrites_an_earlier_runs_files(tmp_path: Path) -> None:
    """An earlier run's checkpoints without last.ckpt, and its metrics.json: training from scratch, from
    another checkpoint, or testing into that directory stops with one line and changes no file."""
    run = tmp_path / "run"
    assert _cli(run, "trainer.max_steps=10", "callbacks.last_checkpoint=null").returncode == 0
    (run / "metrics.json").write_text(json.dumps({"test/bleu": 1.0}))
    before = _digest(run)
    assert any(name.startswith("checkpoints/") for name in before)
    (other,) = (run / "checkpoints").glob("*.ckpt")
    outside = tmp_path / "outside.ckpt"
    outside.write_bytes(other.read_bytes())
    for args, expected in (
        (["trainer.max_steps=4"], "which training from scratch would overwrite"),
        (["trainer.max_steps=4", f"ckpt_path={outside}"], "which training from ckpt_path="),
        (["train=false", "test=true", f"ckpt_path={outside}"], "which this test-only run would overwrite"),
    ):
        done = _cli(run, *args)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert len(errors) == 1 and str(run) in errors[0] and expected in errors[0], errors
        assert _digest(run) == before
