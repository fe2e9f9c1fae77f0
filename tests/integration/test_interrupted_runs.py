"""Reliability promises (docs/reliability.md), checked through the real command line where it matters: a run
interrupted by SIGTERM / SIGINT (mid-epoch, during validation, mid-accumulation with EMA) and resumed equals
the straight run; SIGKILL at random moments, then resume; a second identical signal exits at once."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.helpers import forkserver
from tests.helpers.reliability import (
    EVERY_STEP,
    EXACT,
    HOOK,
    Toy,
    fit_toy,
    load_checkpoint,
    logged_curves,
    train_in,
    train_parallel,
)
from transformer.training.callbacks import NonFiniteLossGuard

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
    results = train_parallel(
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
        assert load_checkpoint(tmp_path / name / "checkpoints" / "last.ckpt")["global_step"] == 7
    in_val = results["in_val"]
    assert in_val.returncode == 128 + signal.SIGTERM, in_val.stderr[-3000:]
    assert "SIGTERM during validation: saved" in (tmp_path / "in_val" / "train.log").read_text()
    in_val_ckpt = load_checkpoint(tmp_path / "in_val" / "checkpoints" / "last.ckpt")
    assert in_val_ckpt["global_step"] == 10  # epoch 1 done
    assert not any(name.startswith("val/") for name, _ in logged_curves(tmp_path / "in_val"))  # not finished

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
    for name, done in train_parallel(resumes).items():
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"

    reference = logged_curves(straight)
    assert ("val/bleu", 9) in reference  # the validation after epoch 1 (logged at its last step)
    for name, first in (("killed", 7), ("in_val", 10)):
        before, after = logged_curves(tmp_path / name), logged_curves(tmp_path / f"{name}_resumed")
        train_steps = {step for metric, step in after if metric.startswith("train/")}
        assert train_steps == set(range(first, 16)), name  # none repeated or missed
        assert {**before, **after} == reference, name  # bitwise equal losses, learning rates, val metrics
        a, b = (
            load_checkpoint(straight / "checkpoints" / "last.ckpt"),
            load_checkpoint(resumes[name][0] / "checkpoints" / "last.ckpt"),
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
    results = train_parallel(
        {
            "straight": (straight, common),
            "killed": (killed, [*common, *term, "+callbacks.sigterm.signal=SIGTERM"]),
        }
    )
    assert results["straight"].returncode == 0, results["straight"].stderr[-3000:]
    assert results["killed"].returncode == 128 + signal.SIGTERM, results["killed"].stderr[-3000:]
    done = train_in(resumed, [*common, f"ckpt_path={killed / 'checkpoints' / 'last.ckpt'}"])
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = logged_curves(killed, once=False), logged_curves(resumed, once=False)
    assert {**before, **after} == logged_curves(straight, once=False)
    a, b = (
        load_checkpoint(straight / "checkpoints" / "last.ckpt"),
        load_checkpoint(resumed / "checkpoints" / "last.ckpt"),
    )
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
        with forkserver.in_a_thread(train_in, run_dir, args) as (pid, run):
            last = run_dir / "checkpoints" / "last.ckpt"
            deadline = time.monotonic() + 300
            while not last.exists() and not run.done() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not run.done(), run.result().stderr[-3000:]
            time.sleep(rng.uniform(0.0, 1.5))  # somewhere among the next steps and their saves
            os.kill(pid, signal.SIGKILL)
            assert run.result().returncode == -signal.SIGKILL
        checkpoint = load_checkpoint(last)  # never half-written
        steps.append(checkpoint["global_step"])
        ckpt = last
    assert steps == sorted(steps) and steps[0] >= 1
    end = steps[-1] + 3
    finish = [*EVERY_STEP, *endless, f"trainer.max_steps={end}", f"ckpt_path={ckpt}"]
    final = train_in(tmp_path / "final", finish)
    assert final.returncode == 0, final.stderr[-3000:]
    assert load_checkpoint(tmp_path / "final" / "checkpoints" / "last.ckpt")["global_step"] == end


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
    model = Toy(set())
    saver = SaveOnSignal(tmp_path / "checkpoints")
    with pytest.raises(SystemExit) as exited:
        fit_toy(
            NonFiniteLossGuard(action="stop"), set(), tmp_path, model, callbacks=[saver, _SignalTwice(sig)]
        )
    assert exited.value.code == 128 + sig
    assert [h["global_step"] for h in model.history] == [1, 2]  # step 3 never ended
    assert not saver.path.exists() and signal.getsignal(sig) is before
