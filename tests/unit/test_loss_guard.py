"""The non-finite-loss guard in `trainer=gpu`'s configuration (bf16-mixed, gradient clipping on): the fused
AdamW skips a NaN step on the guard's device flag, so the clipped NaN gradients touch no weight and no
moment (the toy-model tests in tests/integration/test_reliability.py cover 32-true)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from tests.unit.test_tasks import CopyData, _trainer, _translation
from transformer.training import TranslationTask
from transformer.training.loss_guard import NonFiniteLossGuard

pytestmark = pytest.mark.usefixtures("one_thread")


class _History(L.Callback):
    """The weights and the optimizer's state after each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        optimizer = trainer.optimizers[0]
        state = {f"w.{n}": p.detach().clone() for n, p in module.named_parameters()}
        for name, param in module.named_parameters():
            state.update({f"{k}.{name}": v.clone() for k, v in optimizer.state.get(param, {}).items()})
        self.steps.append(state)


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
    trainer = _trainer(
        tmp_path,
        max_steps=5,
        limit_val_batches=0,
        precision="bf16-mixed",
        gradient_clip_val=1.0,
        callbacks=[guard, history],
    )
    trainer.fit(_poisoned(_translation(), step=3), datamodule=CopyData())
    assert trainer.optimizers[0].defaults["fused"] is True  # the device-side skip, no read per step
    assert guard.skipped == 1
    h = history.steps  # index = step - 1
    assert h[2].keys() == h[1].keys() and all(torch.equal(h[2][k], h[1][k]) for k in h[1])  # step 3: nothing
    for taken in (1, 3):  # steps 2 and 4 moved the weights and moments, and counted Adam's steps
        assert all(not torch.equal(h[taken][k], h[taken - 1][k]) for k in h[taken] if k.startswith("step."))
        assert any(not torch.equal(h[taken][k], h[taken - 1][k]) for k in h[taken] if k.startswith("w."))
    assert all(torch.isfinite(v).all() for v in h[-1].values())
    assert {float(v) for k, v in h[-1].items() if k.startswith("step.")} == {4.0}  # 5 steps, 1 skipped
