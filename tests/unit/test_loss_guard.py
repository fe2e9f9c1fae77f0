"""The non-finite-loss guard in `trainer=gpu`'s configuration (bf16-mixed, gradient clipping on): the fused
AdamW skips a NaN step on the guard's device flag, so the clipped NaN gradients touch no weight and no
moment (the toy-model tests in tests/integration/test_nonfinite_loss.py cover 32-true); and with gradient
accumulation, a NaN in an early micro-batch skips the whole step even when the last one is finite."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch

from tests.helpers.tasks import TINY, CopyData, cpu_trainer, translation_task
from transformer.training import TranslationTask
from transformer.training.loss_guard import NonFiniteLossGuard
from transformer.training.optim import adamw

pytestmark = pytest.mark.usefixtures("one_thread")


class _History(L.Callback):
    """The weights and the optimizer's state after each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.steps.append(self.state(trainer, module))

    @staticmethod
    def state(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
        optimizer = trainer.optimizers[0]
        state = {f"w.{n}": p.detach().clone() for n, p in module.named_parameters()}
        for name, param in module.named_parameters():
            state.update({f"{k}.{name}": v.clone() for k, v in optimizer.state.get(param, {}).items()})
        return state


def _poisoned(task: TranslationTask, step: int) -> TranslationTask:
    """`task` whose training loss is NaN at optimizer step `step` (1-based)."""
    training_step = task.training_step

    def poisoned(batch: Any, batch_idx: int) -> torch.Tensor:
        loss = training_step(batch, batch_idx)
        return loss * float("nan") if task.global_step + 1 == step else loss

    task.training_step = poisoned  # type: ignore[method-assign]
    return task


def test_bf16_mixed_with_clipping_skips_a_nan_step_on_the_device(tmp_path) -> None:
    torch.manual_seed(0)
    guard, history = NonFiniteLossGuard(action="skip"), _History()
    trainer = cpu_trainer(
        tmp_path,
        max_steps=5,
        limit_val_batches=0,
        precision="bf16-mixed",
        gradient_clip_val=1.0,
        callbacks=[guard, history],
    )
    trainer.fit(_poisoned(translation_task(), step=3), datamodule=CopyData())
    assert trainer.optimizers[0].defaults["fused"] is True  # the device-side skip, no read per step
    assert guard.skipped == 1
    h = history.steps  # index = step - 1
    assert h[2].keys() == h[1].keys() and all(torch.equal(h[2][k], h[1][k]) for k in h[1])  # step 3: nothing
    for taken in (1, 3):  # steps 2 and 4 moved the weights and moments, and counted Adam's steps
        assert all(not torch.equal(h[taken][k], h[taken - 1][k]) for k in h[taken] if k.startswith("step."))
        assert any(not torch.equal(h[taken][k], h[taken - 1][k]) for k in h[taken] if k.startswith("w."))
    assert all(torch.isfinite(v).all() for v in h[-1].values())
    assert {float(v) for k, v in h[-1].items() if k.startswith("step.")} == {4.0}  # 5 steps, 1 skipped


class _AfterEachStep(L.Callback):
    """The weights and the optimizer's state after each optimizer step, by step count (with gradient
    accumulation a micro-batch that ends no step records the state of the step before it)."""

    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.after[trainer.global_step] = _History.state(trainer, module)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_a_nan_in_an_early_micro_batch_skips_the_whole_step(tmp_path, fused: bool) -> None:
    """Two micro-batches a step; step 3's first one is NaN, its last one finite: the step changes no
    weight, no Adam moment and no step count, whether the fused AdamW skips it on the device flag or
    the guard drops the gradients (any other optimizer); the steps around it are taken."""
    torch.manual_seed(0)
    guard, history = NonFiniteLossGuard(action="skip"), _AfterEachStep()
    task = TranslationTask(TINY, optimizer=functools.partial(adamw, lr=3e-3, fused=fused))
    training_step = task.training_step

    def poisoned(batch: Any, batch_idx: int) -> torch.Tensor:
        loss = training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 4 else loss  # micro-batches 4, 5: optimizer step 3

    task.training_step = poisoned  # type: ignore[method-assign]
    trainer = cpu_trainer(
        tmp_path, max_steps=4, accumulate_grad_batches=2, limit_val_batches=0, callbacks=[guard, history]
    )
    trainer.fit(task, datamodule=CopyData())
    assert trainer.optimizers[0].defaults["fused"] is fused and trainer.global_step == 4
    assert guard.skipped == 1
    h = history.after
    assert h[3].keys() == h[2].keys() and all(torch.equal(h[3][k], h[2][k]) for k in h[2]), [
        k for k in h[2] if not torch.equal(h[3][k], h[2][k])
    ]
    for taken in (2, 4):
        assert all(not torch.equal(h[taken][k], h[taken - 1][k]) for k in h[taken] if k.startswith("step."))
        assert any(not torch.equal(h[taken][k], h[taken - 1][k]) for k in h[taken] if k.startswith("w."))
    assert all(torch.isfinite(v).all() for v in h[4].values())
    assert {float(v) for k, v in h[4].items() if k.startswith("step.")} == {3.0}  # 4 steps, 1 skipped
