"""Reliability promises (docs/reliability.md), checked through the real command line where it matters: a
NaN/inf training loss is never applied to the weights; it is skipped (weights and optimizer state untouched,
counted) or stops the run naming the step, on the toy LightningModule of tests/helpers/reliability.py and
through train.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.helpers.reliability import (
    HOOK,
    Toy,
    error_line,
    fit_toy,
    load_checkpoint,
    logged_curves,
    toy_schedule,
    train_parallel,
)
from transformer.training.callbacks import NonFiniteLossGuard


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Every tensor changed (a real step moves each weight and each moment)."""
    return a.keys() == b.keys() and not any(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fused", [False, True], ids=["read-per-step", "on-device"])
def test_skip_leaves_weights_and_optimizer_untouched(tmp_path: Path, fused: bool) -> None:
    guard = NonFiniteLossGuard(action="skip")
    model = fit_toy(guard, {3, 4}, tmp_path, Toy({3, 4}, fused))
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
    # it, as the NonFiniteLossGuard docstring says): after step n the rate is 0.1 * toy_schedule(n).
    assert [e["global_step"] for e in h] == list(range(1, 9))
    assert [e["lr"] for e in h] == pytest.approx([0.1 * toy_schedule(n) for n in range(1, 9)], rel=1e-12)
    assert all(torch.isfinite(v).all() for v in h[-1]["weights"].values())


@pytest.mark.parametrize("fused", [False, True], ids=["read-per-step", "on-device"])
def test_stop_names_the_step_before_updating(tmp_path: Path, fused: bool) -> None:
    """Read per step, the guard stops in step 3; on the device it reads back at the end of the epoch
    (step 8), and steps 3 to 8 were skipped by the optimizer: the same weights and moments either way."""
    from transformer.training.callbacks import NonFiniteLossError

    model = Toy({3}, fused)
    with pytest.raises(NonFiniteLossError, match=r"nan at optimizer step 3 .*stopped before updating"):
        fit_toy(NonFiniteLossGuard(action="stop"), {3}, tmp_path, model)
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

    model = Toy({2, 3, 4, 6}, fused)
    with pytest.raises(NonFiniteLossError, match=r"at optimizer step 4 .*3 steps in a row skipped"):
        fit_toy(NonFiniteLossGuard(action="skip", max_consecutive_skips=3), set(), tmp_path, model)
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
    results = train_parallel(
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
    curves = logged_curves(tmp_path / "skip")
    assert [curves[("train/skipped_steps", s)] for s in range(8)] == [0, 0, 1, 2, 2, 2, 2, 2]
    weights = load_checkpoint(tmp_path / "skip" / "checkpoints" / "last.ckpt")["state_dict"]
    assert all(torch.isfinite(v).all() for v in weights.values())

    stop = results["stop"]
    assert stop.returncode == 1, stop.stderr[-3000:]
    line = error_line(stop)
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
