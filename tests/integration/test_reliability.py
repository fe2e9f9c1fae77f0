"""Reliability promises (docs/reliability.md), checked through the real command line where it matters:
exact resume after SIGTERM mid-epoch, checkpoints on SIGTERM / SIGINT, SIGKILL at random moments,
atomic checkpoint files, NaN/inf losses skipped or stopped, hostile input refused in one line.

The test-only hooks that the CLI runs load by `_target_` are in tests/helpers/callbacks.py (HOOK).
"""

from __future__ import annotations

import csv
import ctypes
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from tests.helpers import forkserver
from tests.helpers.cli import TINY as TRAIN_TINY
from tests.helpers.driver import run_in_one_interpreter
from tests.helpers.refusals import MaliciousPickle, snapshot
from tests.helpers.repo import REPO_ROOT, cli_env
from transformer.training import checkpoint_io
from transformer.training.callbacks import NonFiniteLossGuard
from transformer.training.checkpoint_io import AtomicCheckpointIO, atomic_torch_save

# The tiny quickstart of train_cli (600 examples = 10 steps per epoch), 5 epochs, no test, no selection metric
TINY = [
    *(o for o in TRAIN_TINY if not o.startswith("trainer.max_epochs=")),
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


# --- helpers -------------------------------------------------------------------------------------------


def _cmd(run_dir: Path, args: list[str]) -> list[str]:
    other_data = any(arg.startswith("experiment=") for arg in args)  # no synthetic sizes to set there
    base = [a for a in TINY if not (other_data and a.startswith("data.synthetic_sizes"))]
    return [sys.executable, str(REPO_ROOT / "train.py"), *base, f"hydra.run.dir={run_dir}", *args]


def _cli(run_dir: Path, args: list[str], **run: Any) -> subprocess.CompletedProcess[str]:
    return forkserver.run(_cmd(run_dir, args), cwd=run_dir.parent, env=cli_env(), timeout=600, **run)


def _parallel(jobs: dict[str, tuple[Path, list[str]]]) -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(max_workers=2) as pool:  # each run is mostly interpreter start-up
        futures = {name: pool.submit(_cli, run_dir, args) for name, (run_dir, args) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def _curves(run_dir: Path, once: bool = True) -> dict[tuple[str, int], float]:
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


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else ""


# --- exact resume, SIGTERM / SIGINT ---------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_equals_the_straight_run(tmp_path: Path) -> None:
    """16 steps straight == SIGTERM at step 7 (mid-epoch: 10 steps per epoch) + resume to 16: the same
    loss and learning rate at every step, no step repeated or skipped, bitwise the same weights. The
    same for a SIGTERM during the validation after epoch 1: the run stops without finishing the
    validation, and the resumed run validates again before training on."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    term = [f"+callbacks.sigterm._target_={HOOK}.SignalAtStep", "+callbacks.sigterm.step=6"]
    in_val = [
        f"+callbacks.sigterm._target_={HOOK}.SignalDuringValidation",
        "+callbacks.sigterm.epoch=0",
        "+callbacks.sigterm.batch=0",
        "+callbacks.sigterm.signal=SIGTERM",
    ]
    results = _parallel(
        {
            "straight": (straight, [*EXACT, *EVERY_STEP, "trainer.max_steps=16"]),
            "killed": (killed, [*EXACT, "trainer.max_steps=16", *term, "+callbacks.sigterm.signal=SIGTERM"]),
            "sigint": (
                tmp_path / "sigint",
                ["trainer.max_steps=16", *term, "+callbacks.sigterm.signal=SIGINT"],
            ),
            "in_val": (tmp_path / "in_val", [*EXACT, "trainer.max_steps=16", *in_val]),
        }
    )
    assert results["straight"].returncode == 0, results["straight"].stderr[-3000:]
    for name, status in (("killed", 128 + signal.SIGTERM), ("sigint", 128 + signal.SIGINT)):
        assert results[name].returncode == status, results[name].stderr[-3000:]
        assert "resume with ckpt_path=" in (tmp_path / name / "train.log").read_text()
        # the signal arrived at the end of step 6; the step in flight (7) finished, then the save
        assert _load(tmp_path / name / "checkpoints" / "last.ckpt")["global_step"] == 7
    in_val = results["in_val"]
    assert in_val.returncode == 128 + signal.SIGTERM, in_val.stderr[-3000:]
    assert "SIGTERM during validation: saved" in (tmp_path / "in_val" / "train.log").read_text()
    assert _load(tmp_path / "in_val" / "checkpoints" / "last.ckpt")["global_step"] == 10  # epoch 1 done
    assert not any(name.startswith("val/") for name, _ in _curves(tmp_path / "in_val"))  # not finished

    resumes = {
        name: (
            tmp_path / f"{name}_resumed",
            [*EXACT, *EVERY_STEP, "trainer.max_steps=16", f"ckpt_path={ckpt}"],
        )
        for name, ckpt in (
            ("killed", killed / "checkpoints" / "last.ckpt"),
            ("in_val", tmp_path / "in_val" / "checkpoints" / "last.ckpt"),
        )
    }
    for name, done in _parallel(resumes).items():
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"

    reference = _curves(straight)
    assert ("val/bleu", 9) in reference  # the validation after epoch 1 (logged at its last step)
    for name, first in (("killed", 7), ("in_val", 10)):
        before, after = _curves(tmp_path / name), _curves(tmp_path / f"{name}_resumed")
        train_steps = {step for metric, step in after if metric.startswith("train/")}
        assert train_steps == set(range(first, 16)), name  # none repeated or missed
        assert {**before, **after} == reference, name  # bitwise equal losses, learning rates, val metrics
        a, b = (
            _load(straight / "checkpoints" / "last.ckpt"),
            _load(resumes[name][0] / "checkpoints" / "last.ckpt"),
        )
        assert a["global_step"] == b["global_step"] == 16
        for key, value in a["state_dict"].items():
            assert torch.equal(value, b["state_dict"][key]), f"{name}: {key}"
        for state_a, state_b in zip(
            a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()
        ):
            assert all(torch.equal(state_a[k], state_b[k]) for k in state_a), name


@pytest.mark.slow
def test_sigterm_mid_accumulation_with_ema_then_resume_equals_the_straight_run(tmp_path: Path) -> None:
    """The README's exact resume with an EMA of the weights (the SST-2 recipe) and accumulate_grad_batches
    > 1: SIGTERM at the end of micro-batch 5 (the first half of optimizer step 3's window), resume to 8
    optimizer steps: bitwise the same losses, averaged and raw weights as the straight run."""
    straight, killed, resumed = tmp_path / "straight", tmp_path / "killed", tmp_path / "resumed"
    common = [
        *EXACT,
        *EVERY_STEP,
        "trainer.max_steps=8",
        "trainer.accumulate_grad_batches=2",
        "callbacks=[default,ema]",
    ]
    term = [f"+callbacks.sigterm._target_={HOOK}.SignalAtBatch", "+callbacks.sigterm.batch=3"]
    results = _parallel(
        {
            "straight": (straight, common),
            "killed": (killed, [*common, *term, "+callbacks.sigterm.signal=SIGTERM"]),
        }
    )
    assert results["straight"].returncode == 0, results["straight"].stderr[-3000:]
    assert results["killed"].returncode == 128 + signal.SIGTERM, results["killed"].stderr[-3000:]
    done = _cli(resumed, [*common, f"ckpt_path={killed / 'checkpoints' / 'last.ckpt'}"])
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = _curves(killed, once=False), _curves(resumed, once=False)
    assert {**before, **after} == _curves(straight, once=False)
    a, b = _load(straight / "checkpoints" / "last.ckpt"), _load(resumed / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 8
    for part in ("state_dict", "current_model_state"):
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), f"{part}: {key}"


# --- crash safety: SIGKILL, atomic files ---------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(tmp_path: Path) -> None:
    """SIGKILL a run (checkpointing every step) at random moments, three times in a row, each time
    resuming from the killed run's last.ckpt: it always loads, and the last resume finishes the run."""
    rng = random.Random(0)
    endless = ["trainer.max_epochs=-1", "~callbacks.early_stopping"]  # only max_steps ends a run
    ckpt: Path | None = None
    steps = []
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        long_run = ["trainer.max_steps=1000000", *endless]  # only the SIGKILL ends it
        args = [*EVERY_STEP, *long_run, *([f"ckpt_path={ckpt}"] if ckpt else [])]
        with forkserver.in_a_thread(_cli, run_dir, args) as (pid, run):
            last = run_dir / "checkpoints" / "last.ckpt"
            deadline = time.monotonic() + 300
            while not last.exists() and not run.done() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not run.done(), run.result().stderr[-3000:]
            time.sleep(rng.uniform(0.0, 1.5))  # somewhere among the next steps and their saves
            os.kill(pid, signal.SIGKILL)
            assert run.result().returncode == -signal.SIGKILL
        checkpoint = _load(last)  # never half-written
        steps.append(checkpoint["global_step"])
        ckpt = last
    assert steps == sorted(steps) and steps[0] >= 1
    end = steps[-1] + 3
    finish = [*EVERY_STEP, *endless, f"trainer.max_steps={end}", f"ckpt_path={ckpt}"]
    final = _cli(tmp_path / "final", finish)
    assert final.returncode == 0, final.stderr[-3000:]
    assert _load(tmp_path / "final" / "checkpoints" / "last.ckpt")["global_step"] == end


_WRITER = """
import sys, torch
from pathlib import Path
from transformer.training.checkpoint_io import atomic_torch_save
path, started = Path(sys.argv[1]), Path(sys.argv[2])
for i in range(1, 10**6):
    atomic_torch_save({"version": i, "weights": torch.full((4_000_000,), float(i))}, path)
    started.touch()  # one version is complete
"""


@pytest.mark.slow
def test_atomic_save_survives_sigkill_mid_write(tmp_path: Path) -> None:
    """A process rewriting a 16 MB checkpoint in a loop, SIGKILLed at random moments: the file is always
    one complete version (old or new), never a truncated mix."""
    path = tmp_path / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    rng = random.Random(1)
    for attempt in range(4):
        started = tmp_path / f"started{attempt}"
        command = [sys.executable, "-c", _WRITER, str(path), str(started)]
        writer = forkserver.in_a_thread(forkserver.run, command, cwd=REPO_ROOT, env=cli_env(), timeout=300)
        with writer as (pid, run):
            deadline = time.monotonic() + 300
            while not started.exists() and not run.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not run.done(), run.result().stderr[-3000:]
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGKILL)
            assert run.result().returncode == -signal.SIGKILL
        checkpoint = _load(path)
        assert torch.equal(checkpoint["weights"], torch.full((4_000_000,), float(checkpoint["version"])))
    # the kills left temporary files behind (some of them); the next save clears every one
    atomic_torch_save({"version": 0}, path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    assert _load(path) == {"version": 0}


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full (simulated)")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "x": _Unpicklable()}, path)
    assert torch.equal(_load(path)["state_dict"]["w"], torch.ones(3))
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temp file left behind
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_temp_files_are_removed_by_the_next_save_or_load(tmp_path: Path) -> None:
    """Temporary files of killed writers on this host go; those of live writers, of other hosts (a shared
    filesystem) and anything else stay."""
    host, dead = checkpoint_io._HOST, _dead_pid()
    stale = tmp_path / f".last.ckpt.{host}.{dead}.abc123.tmp"
    alive = tmp_path / f".last.ckpt.{host}.{os.getppid()}.abc123.tmp"
    foreign = tmp_path / f".last.ckpt.{host}x.{dead}.abc123.tmp"
    other = tmp_path / "notes.tmp"
    for path in (stale, alive, foreign, other):
        path.write_bytes(b"partial")
    atomic_torch_save({"step": 1}, tmp_path / "epoch_001.ckpt")
    assert not stale.exists() and alive.exists() and foreign.exists() and other.exists()

    stale.write_bytes(b"partial")
    AtomicCheckpointIO().load_checkpoint(tmp_path / "epoch_001.ckpt")  # what a resume calls
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["epoch_001.ckpt", alive.name, foreign.name, other.name]
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_atomic_torch_save_round_trip(tmp_path: Path) -> None:
    atomic_torch_save({"a": torch.arange(3)}, tmp_path / "x.ckpt")
    assert torch.equal(_load(tmp_path / "x.ckpt")["a"], torch.arange(3))


# --- numerical faults ----------------------------------------------------------------------------------


def _decay(step: int) -> float:
    """The toy's learning-rate schedule: a factor that changes at every optimizer step."""
    return 1.0 / (1.0 + step)


class _Toy(L.LightningModule):
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
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=1)


def _fit(
    guard: NonFiniteLossGuard,
    nan_steps: set[int],
    tmp_path: Path,
    model: _Toy | None = None,
    callbacks: list[L.Callback] = (),
) -> _Toy:
    model = model or _Toy(nan_steps)
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


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Every tensor changed (a real step moves each weight and each moment)."""
    return a.keys() == b.keys() and not any(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fused", [False, True], ids=["read-per-step", "on-device"])
def test_skip_leaves_weights_and_optimizer_untouched(tmp_path: Path, fused: bool) -> None:
    guard = NonFiniteLossGuard(action="skip")
    model = _fit(guard, {3, 4}, tmp_path, _Toy({3, 4}, fused))
    h = model.history
    assert guard.skipped == 2 and len(h) == 8
    names = {f"{n}.{k}" for n, _ in model.named_parameters() for k in ("exp_avg", "exp_avg_sq", "step")}
    assert set(h[0]["optimizer"]) == names
    for skipped in (2, 3):  # history index = step - 1: steps 3 and 4 changed no weight and no moment
        assert _same(h[skipped]["weights"], h[skipped - 1]["weights"]), skipped
        assert _same(h[skipped]["optimizer"], h[skipped - 1]["optimizer"]), skipped
    for trained in (1, 4):  # steps 2 and 5 (after the skips) moved every weight, moment and step count
        assert _differ(h[trained]["weights"], h[trained - 1]["weights"]), trained
        assert _differ(h[trained]["optimizer"], h[trained - 1]["optimizer"]), trained
    # Adam's step counts (its bias correction) count the 6 applied steps only.
    assert all(h[-1]["optimizer"][f"{n}.step"].item() == 6 for n, _ in model.named_parameters())
    # By design the learning-rate schedule still advances on a skipped step (the global step counts
    # it, as the NonFiniteLossGuard docstring says): after step n the rate is 0.1 * _decay(n).
    assert [e["global_step"] for e in h] == list(range(1, 9))
    assert [e["lr"] for e in h] == pytest.approx([0.1 * _decay(n) for n in range(1, 9)], rel=1e-12)
    assert all(torch.isfinite(v).all() for v in h[-1]["weights"].values())


@pytest.mark.parametrize("fused", [False, True], ids=["read-per-step", "on-device"])
def test_stop_names_the_step_before_updating(tmp_path: Path, fused: bool) -> None:
    """Read per step, the guard stops in step 3; on the device it reads back at the end of the epoch
    (step 8), and steps 3 to 8 were skipped by the optimizer: the same weights and moments either way."""
    from transformer.training.callbacks import NonFiniteLossError

    model = _Toy({3}, fused)
    with pytest.raises(NonFiniteLossError, match=r"nan at optimizer step 3 .*stopped before updating"):
        _fit(NonFiniteLossGuard(action="stop"), {3}, tmp_path, model)
    last_good = model.history[1]
    assert len(model.history) == (8 if fused else 2) and last_good["global_step"] == 2
    for later in model.history[2:]:
        assert _same(later["weights"], last_good["weights"]) and _same(
            later["optimizer"], last_good["optimizer"]
        )
    optimizer = model.trainer.optimizers[0]
    moments = {
        f"{name}.{key}": value
        for name, param in model.named_parameters()
        for key, value in optimizer.state.get(param, {}).items()
    }
    assert _same(model.state_dict(), last_good["weights"])  # step 3 touched no weight
    assert len(moments) == 6 and _same(moments, last_good["optimizer"])  # nor a moment or the step count


@pytest.mark.parametrize("fused", [False, True], ids=["read-per-step", "on-device"])
def test_skip_gives_up_after_consecutive_skips(tmp_path: Path, fused: bool) -> None:
    from transformer.training.callbacks import NonFiniteLossError

    model = _Toy({2, 3, 4, 6}, fused)
    with pytest.raises(NonFiniteLossError, match=r"at optimizer step 4 .*3 steps in a row skipped"):
        _fit(NonFiniteLossGuard(action="skip", max_consecutive_skips=3), set(), tmp_path, model)
    after_step_1 = model.history[0]  # steps 2, 3, 4 skipped, then the run halted: 5 and later no-ops
    assert len(model.history) == (8 if fused else 3)
    for later in model.history[1:]:
        assert _same(later["weights"], after_step_1["weights"])


def test_guard_arguments() -> None:
    with pytest.raises(ValueError, match="action"):
        NonFiniteLossGuard(action="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        NonFiniteLossGuard(max_consecutive_skips=0)


@pytest.mark.slow
def test_cli_nan_loss_skip_and_stop(tmp_path: Path) -> None:
    poison = [f"+callbacks.poison._target_={HOOK}.PoisonSteps", "+callbacks.poison.steps=[3,4]"]
    results = _parallel(
        {
            "skip": (
                tmp_path / "skip",
                ["trainer.max_steps=8", *poison, "callbacks.non_finite_loss.action=skip"],
            ),
            "stop": (
                tmp_path / "stop",
                [
                    "trainer.max_steps=8",
                    "model.optimizer.lr=1e30",
                    f"+callbacks.record._target_={HOOK}.RecordStop",
                    f"+callbacks.record.path={tmp_path / 'stop_state.pt'}",
                ],
            ),
        }
    )
    skip = results["skip"]
    assert skip.returncode == 0, skip.stderr[-3000:]
    assert "step skipped" in (tmp_path / "skip" / "train.log").read_text()
    curves = _curves(tmp_path / "skip")
    assert [curves[("train/skipped_steps", s)] for s in range(8)] == [0, 0, 1, 2, 2, 2, 2, 2]
    weights = _load(tmp_path / "skip" / "checkpoints" / "last.ckpt")["state_dict"]
    assert all(torch.isfinite(v).all() for v in weights.values())

    stop = results["stop"]
    assert stop.returncode == 1, stop.stderr[-3000:]
    line = _error_line(stop)
    assert line.startswith("error: training loss is nan at optimizer step "), stop.stderr[-3000:]
    assert "Traceback" not in stop.stderr
    state = torch.load(tmp_path / "stop_state.pt", weights_only=True)
    steps, at_error = state["steps"], state["at_error"]
    bad = int(re.match(r"error: training loss is nan at optimizer step (\d+) ", line).group(1))
    good = steps[bad - 1]  # after the step before the one the error names
    assert bad >= 2 and good["optimizer"] and good["weights"] != steps[bad - 2]["weights"]  # a real update
    assert (
        at_error["weights"] == good["weights"]
    )  # the step that stopped, and any after it, updated no weight
    assert at_error["optimizer"] == good["optimizer"]  # nor a moment or the optimizer's step count


# --- hostile input: one line, non-zero exit, nothing written over --------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    done = _cli(run_dir, ["trainer.max_steps=3"])
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def _hostile_cases(root: Path, run: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """name -> (train.py arguments, texts the one error line must contain: what is wrong, not only where)."""
    last = run / "checkpoints" / "last.ckpt"
    data = last.read_bytes()
    (root / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    torch.save({"state_dict": {}, "payload": MaliciousPickle(root / "pwned")}, root / "evil.ckpt")
    (root / "evil_raw.ckpt").write_bytes(
        pickle.dumps({"state_dict": {}, "x": MaliciousPickle(root / "pwned")})
    )
    classification = _load(last)
    classification["config"]["model"]["_target_"] = "transformer.training.ClassificationTask"
    torch.save(classification, root / "classification.ckpt")
    multi30k = root / "multi30k"
    multi30k.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("de", "en"):
            (multi30k / f"{split}.{lang}").write_bytes(os.urandom(3000))  # binary given as text
    gz = root / "gz"
    gz.mkdir()
    import gzip

    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("de", "en"):
            blob = gzip.compress(b"a small sentence .\n" * 200)
            (gz / f"{split}.{lang}.gz").write_bytes(blob[: len(blob) // 2])  # truncated gzip
    (root / "a_file").write_text("not a directory\n")
    m30 = ["experiment=multi30k_de_en", "data.vocab_size=300"]
    return {
        "unknown_key": (["model.config.d_modle=64"], ("d_modle",)),
        "unknown_top_key": (["lrr=1"], ("lrr",)),
        "unknown_experiment": (["experiment=quickstrat"], ("quickstart",)),
        "wrong_type_lr": (["model.optimizer.lr=abc"], ("model.optimizer.lr",)),
        "wrong_type_epochs": (["trainer.max_epochs=abc"], ("trainer.max_epochs",)),
        "negative_lr": (["model.optimizer.lr=-1"], ("lr",)),
        "dropout_one": (["model.config.dropout=1.0"], ("dropout",)),
        "max_tokens_too_small": (["data.max_tokens=5"], ("max_tokens",)),
        "missing_data_dir": ([*m30, f"data.data_dir={root / 'nope'}"], (f"{root / 'nope'} does not exist",)),
        "binary_as_text": ([*m30, f"data.data_dir={multi30k}"], (str(multi30k), "invalid UTF-8")),
        "truncated_gzip": ([*m30, f"data.data_dir={gz}"], (f"cannot read {gz}", ".gz")),
        "truncated_checkpoint": (
            [f"ckpt_path={root / 'truncated.ckpt'}"],
            ("truncated.ckpt", "truncated or corrupt"),
        ),
        "malicious_checkpoint": ([f"ckpt_path={root / 'evil.ckpt'}"], ("evil.ckpt", "refusing to load")),
        "malicious_raw_pickle": (
            [f"ckpt_path={root / 'evil_raw.ckpt'}"],
            ("evil_raw.ckpt", "refusing to load"),
        ),
        "other_task_checkpoint": (
            [f"ckpt_path={root / 'classification.ckpt'}"],
            ("holds a classification model", "this run builds TranslationTask"),
        ),
        "other_model_checkpoint": (
            [f"ckpt_path={last}", "model.config.d_model=64"],
            ("does not fit", "d_model"),
        ),
        "output_dir_is_a_file": (
            [f"paths.output_dir={root / 'a_file' / 'run'}"],
            ("a_file", "is not writable"),
        ),
    }


@pytest.fixture(scope="module")
def hostile_runs(finished_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hostile")
    cases = _hostile_cases(root, finished_run)
    before = snapshot(finished_run)
    in_driver = [name for name in cases if name != HOSTILE_FORKED]
    steps = [
        {
            "script": "train.py",
            "args": _cmd(root / name, cases[name][0])[2:],
            "cwd": str(root),
            "subprocess": name == HOSTILE_FRESH,
        }
        for name in in_driver
    ]
    results = dict(zip(in_driver, run_in_one_interpreter(steps), strict=True))
    results[HOSTILE_FORKED] = _cli(root / HOSTILE_FORKED, cases[HOSTILE_FORKED][0])
    return {"root": root, "cases": cases, "results": results, "before": before, "run": finished_run}


# the cases run in one interpreter (tests/helpers/driver.py), but two as a process of their own, with the exit
# status, stderr and "no traceback" of a real `python train.py`: Hydra's errors in a fresh interpreter, as a
# user starts it (what its imports print counts too); the pickle's payload in a process forked from the
# warm one
HOSTILE_FRESH, HOSTILE_FORKED = "unknown_key", "malicious_raw_pickle"
HOSTILE = [
    "unknown_key",
    "unknown_top_key",
    "unknown_experiment",
    "wrong_type_lr",
    "wrong_type_epochs",
    "negative_lr",
    "dropout_one",
    "max_tokens_too_small",
    "missing_data_dir",
    "binary_as_text",
    "truncated_gzip",
    "truncated_checkpoint",
    "malicious_checkpoint",
    "malicious_raw_pickle",
    "other_task_checkpoint",
    "other_model_checkpoint",
    "output_dir_is_a_file",
]


@pytest.mark.slow
@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_input_is_one_line_nonzero_and_writes_nothing(
    hostile_runs: dict[str, Any], case: str
) -> None:
    result = hostile_runs["results"][case]
    expected = hostile_runs["cases"][case][1]
    assert result.returncode == 1, (result.stdout[-1000:], result.stderr[-3000:])
    line = _error_line(result)
    assert line.startswith("error: ") and all(text in line for text in expected), (expected, line)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (hostile_runs["root"] / "pwned").exists()  # the planted payload never ran
    assert not list((hostile_runs["root"] / case).rglob("*.ckpt"))  # nothing trained, nothing saved
    assert snapshot(hostile_runs["run"]) == hostile_runs["before"]  # the finished run is untouched


@pytest.mark.slow
def test_unknown_experiment_lists_the_valid_ones(hostile_runs: dict[str, Any]) -> None:
    line = _error_line(hostile_runs["results"]["unknown_experiment"])
    for path in (REPO_ROOT / "configs" / "experiment").glob("*.yaml"):
        assert path.stem in line, line


def _without_root_file_override() -> None:
    """`preexec_fn` of a run as root: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the capability
    bounding set, so that the program executed next, root as it is, obeys file mode bits as any user
    does (root keeps them otherwise, and would write into a read-only directory)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH (linux/capability.h)
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@pytest.mark.slow
def test_read_only_output_dir(tmp_path: Path) -> None:
    """A directory the run may not write into (mode 0555): one error line naming it, exit 1. Run as root
    (CI), the run loses the capabilities that let root ignore the mode bits."""
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    run_dir = tmp_path / "run"
    root = os.geteuid() == 0
    try:
        result = subprocess.run(
            _cmd(run_dir, [f"paths.output_dir={read_only / 'run'}"]),
            cwd=tmp_path,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=600,
            preexec_fn=_without_root_file_override if root else None,
        )
    except subprocess.SubprocessError as err:  # the capability could not be dropped (no CAP_SETPCAP)
        pytest.skip(f"running as root, and cannot drop CAP_DAC_OVERRIDE for the run: {err}")
    finally:
        read_only.chmod(0o755)
    assert result.returncode == 1, result.stderr[-3000:]
    line = _error_line(result)
    assert line.startswith("error: ") and f"{read_only / 'run'}" in line and "Permission denied" in line, line
    assert "Traceback" not in result.stderr
    assert list(read_only.iterdir()) == []


class _SignalTwice(L.Callback):
    """At the start of training step 3, send this process `signal` twice (the second before the step ends)."""

    def __init__(self, sig: signal.Signals) -> None:
        self.sig = sig

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2:
            os.kill(os.getpid(), self.sig)
            os.kill(os.getpid(), self.sig)  # the handler runs before the next bytecode: asked twice


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_second_identical_signal_exits_at_once(tmp_path: Path, sig: signal.Signals) -> None:
    """README: a second identical signal exits at once: 128 + signal, inside the step in flight (which never
    ends), no checkpoint written, the previous handlers back. One signal alone saves after the step."""
    from transformer.training.callbacks import SaveOnSignal

    before = signal.getsignal(sig)
    model = _Toy(set())
    saver = SaveOnSignal(tmp_path / "checkpoints")
    with pytest.raises(SystemExit) as exited:
        _fit(NonFiniteLossGuard(action="stop"), set(), tmp_path, model, callbacks=[saver, _SignalTwice(sig)])
    assert exited.value.code == 128 + sig
    assert [h["global_step"] for h in model.history] == [1, 2]  # step 3 never ended
    assert not saver.path.exists() and signal.getsignal(sig) is before
