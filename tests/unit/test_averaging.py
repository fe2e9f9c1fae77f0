"""The EMA of the weights (`transformer.training.averaging`): the same average as torch's `AveragedModel`
with Lightning's EMA function (what the callback computed before it updated on the device), and a resumed
run that continues the saved average instead of starting a new one."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from tests.helpers.tasks import CopyData, cpu_trainer, translation_task
from transformer.training.averaging import EMAWeightAveraging

pytestmark = pytest.mark.usefixtures("one_thread")


class TorchsAverage(L.Callback):
    """torch's `AveragedModel.update_parameters` with `get_ema_avg_fn`, after every optimizer step: the
    reference (Lightning's EMAWeightAveraging as it is)."""

    def __init__(self, decay: float, use_buffers: bool) -> None:
        self.decay, self.use_buffers = decay, use_buffers
        self.average: AveragedModel | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        avg_fn = get_ema_avg_fn(self.decay)
        self.average = AveragedModel(pl_module, avg_fn=avg_fn, use_buffers=self.use_buffers)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        self.average.update_parameters(pl_module)


@pytest.mark.parametrize("use_buffers", [False, True], ids=["parameters", "with_buffers"])
def test_the_average_is_torchs_ema(tmp_path, use_buffers: bool) -> None:
    """10 steps, decay 0.8: the averaged parameters (and, with `use_buffers`, buffers) equal torch's
    `decay * ema + (1 - decay) * x` within rounding, and they are an average (not the last weights)."""
    torch.manual_seed(0)
    task = translation_task()
    ema, reference = EMAWeightAveraging(decay=0.8, use_buffers=use_buffers), TorchsAverage(0.8, use_buffers)
    raw: list[torch.Tensor] = []

    class Raw(L.Callback):
        def on_train_batch_end(self, trainer, module, *args) -> None:
            raw[:] = [p.detach().clone() for p in module.parameters()]

    trainer = cpu_trainer(
        tmp_path, max_steps=10, max_epochs=2, limit_val_batches=0, callbacks=[Raw(), ema, reference]
    )
    trainer.fit(task, datamodule=CopyData())
    assert trainer.global_step == 10
    averaged = [*ema._average_model.module.parameters(), *ema._average_model.module.buffers()]
    expected = [*reference.average.module.parameters(), *reference.average.module.buffers()]
    for mine, torchs in zip(averaged, expected, strict=True):
        torch.testing.assert_close(mine, torchs, rtol=1e-5, atol=1e-6)
    assert int(ema._average_model.n_averaged) == int(reference.average.n_averaged) == 10  # for checkpoints
    # after training the task holds the average; it is not the last step's weights
    for held, mine in zip(task.parameters(), ema._average_model.module.parameters()):
        assert torch.equal(held, mine)
    assert any(not torch.allclose(held, last) for held, last in zip(task.parameters(), raw))


def test_a_resumed_run_continues_the_saved_average(tmp_path) -> None:
    """Saved at step 3 (after that step's update) and resumed for one step: the average is
    `decay * saved + (1 - decay) * weights after step 4`, not a fresh copy of those weights (the host's
    update count comes back from the checkpoint's `n_averaged`)."""
    path = tmp_path / "step3.ckpt"

    class SaveAtStep3(L.Callback):
        def on_train_batch_end(self, trainer, module, *args) -> None:
            if trainer.global_step == 3:
                trainer.save_checkpoint(path)

    torch.manual_seed(0)
    trainer = cpu_trainer(tmp_path, max_steps=3, limit_val_batches=0)
    trainer.callbacks[:0] = [EMAWeightAveraging(decay=0.8), SaveAtStep3()]  # saved after the EMA's update
    trainer.fit(translation_task(), datamodule=CopyData())
    saved = torch.load(path, weights_only=True)["state_dict"]  # the average at step 3
    assert int(torch.load(path, weights_only=True)["averaging_state"]["n_averaged"]) == 3

    raw: dict[str, torch.Tensor] = {}

    class Raw(L.Callback):
        def on_train_batch_end(self, trainer, module, *args) -> None:
            raw.update({k: v.detach().clone() for k, v in module.named_parameters()})

    task = translation_task()
    trainer = cpu_trainer(
        tmp_path, max_steps=4, limit_val_batches=0, callbacks=[Raw(), EMAWeightAveraging(decay=0.8)]
    )
    trainer.fit(task, datamodule=CopyData(), ckpt_path=path)
    assert trainer.global_step == 4
    for name, value in task.named_parameters():  # the average, copied into the task at the end
        torch.testing.assert_close(value, 0.8 * saved[name] + 0.2 * raw[name], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(saved[name], raw[name]) or name.endswith("bias")


class TorchsAveragePerStep(L.Callback):
    """torch's `AveragedModel` with `get_ema_avg_fn`, updated by a post-step hook on the optimizer itself:
    once per optimizer step whatever Lightning does between steps (the reference under accumulation)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.average: AveragedModel | None = None
        self.steps = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.average = AveragedModel(pl_module, avg_fn=get_ema_avg_fn(self.decay), use_buffers=False)

        def update(*_: object) -> None:
            self.average.update_parameters(pl_module)
            self.steps += 1

        trainer.optimizers[0].register_step_post_hook(update)


def test_gradient_accumulation_averages_once_per_optimizer_step(tmp_path) -> None:
    """Three micro-batches a step (8 batches an epoch: the third step of each is 2 micro-batches), 5 steps:
    `n_averaged` is 5 (one per step, not one per micro-batch), and the average is torch's EMA updated after
    each optimizer step."""
    torch.manual_seed(0)
    task = translation_task()
    ema, reference = EMAWeightAveraging(decay=0.8), TorchsAveragePerStep(0.8)
    trainer = cpu_trainer(
        tmp_path,
        max_steps=5,
        max_epochs=2,
        accumulate_grad_batches=3,
        limit_val_batches=0,
        callbacks=[ema, reference],
    )
    trainer.fit(task, datamodule=CopyData())
    assert trainer.global_step == reference.steps == 5
    assert int(ema._average_model.n_averaged) == int(reference.average.n_averaged) == 5
    for mine, torchs in zip(
        ema._average_model.module.parameters(), reference.average.module.parameters(), strict=True
    ):
        torch.testing.assert_close(mine, torchs, rtol=1e-5, atol=1e-6)
