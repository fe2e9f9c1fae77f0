"""The exponential moving average of the weights (Polyak averaging): evaluated the way it was selected, and
updated on the device with no read back to the host."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging as _LightningEMA
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn


class EMAWeightAveraging(_LightningEMA):
    """Lightning's exponential moving average of the weights, evaluated the way it was selected.

    Validation runs on the averaged weights and checkpoints store them as `state_dict` (the raw ones as
    `current_model_state`, for resuming). Lightning's callback, once set up for fit, also restores the
    raw weights when `trainer.test(ckpt_path=...)` loads a checkpoint, so the final test of `train.py`
    would score other weights than validation chose and `evaluate.py` scores. Outside fit this keeps
    the averaged `state_dict`.

    Only the parameters are averaged (`use_buffers=False`; Lightning's default averages the buffers
    too). The models' buffers are constant tables built from the config (sinusoidal and rotary position
    tables, not saved in checkpoints): Lightning's `decay * ema + (1 - decay) * x` does not keep a
    constant constant, it moves 17% of a d512 position table by up to 1.3e-5 within 1,000 steps, so
    validation ran on other position encodings than the checkpoint gives `evaluate.py`, and a resumed
    run (fresh tables) validated differently from a straight one.

    The update reads nothing back: torch's `AveragedModel.update_parameters` asks its device counter
    `n_averaged` twice per step whether this is the first update (two waits for the device). Here the
    host keeps its own count (read from the checkpoint once, on resume), and the update is one foreach
    `lerp_` over the weights (`ema + (1 - decay) * (x - ema)`: torch's EMA, equal to Lightning's
    `decay * ema + (1 - decay) * x` up to rounding). `n_averaged` still counts on the device, for
    checkpoints.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        use_buffers: bool = False,
        decay: float = 0.999,
        **kwargs: Any,
    ) -> None:  # Lightning's signature, its other default
        super().__init__(device, use_buffers, decay=decay, **kwargs)
        self.decay = decay
        self._updates = 0  # the host's copy of the averaged model's `n_averaged`

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():
            # Lightning warns for any task that overrides configure_model, in case it shards its layers
            # (FSDP), which its AveragedModel would not; ours freezes, adds LoRA adapters and compiles
            # there (BaseTask.configure_model), never shards, so the memory warning is noise at every start
            warnings.filterwarnings(
                "ignore", message="You're using the WeightAveraging callback with a model"
            )
            super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._updates = 0  # a fresh average (a resumed one is counted in `on_load_checkpoint`)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:  # Lightning's schedule, this update
        step_idx = trainer.global_step - 1  # zero-based, as Lightning passes it
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            self._update(pl_module)
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._update(pl_module)
            self._latest_update_epoch = epoch

    @torch.no_grad()
    def _update(self, pl_module: L.LightningModule) -> None:
        """Fold the current weights into the average (the first update copies them), on the device."""
        average = self._average_model
        assert average is not None, "set up for fit"
        averaged = _tensors(average.module, self._use_buffers)
        current = _on(averaged, _tensors(pl_module, self._use_buffers))
        if self._updates == 0:
            torch._foreach_copy_(averaged, current)
        else:
            _ema(averaged, current, self.decay)
        if not self._use_buffers:  # the buffers follow the model as they are
            buffers = [b.detach() for b in average.module.buffers()]
            if buffers:
                torch._foreach_copy_(buffers, _on(buffers, [b.detach() for b in pl_module.buffers()]))
        average.n_averaged += 1
        self._updates += 1

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
            if self._average_model is not None:
                self._updates = int(self._average_model.n_averaged)  # one read, on resume


def _tensors(module: nn.Module, with_buffers: bool) -> list[Tensor]:
    """What is averaged, detached, in the order `AveragedModel` averages it."""
    tensors = [*module.parameters(), *(module.buffers() if with_buffers else ())]
    return [t.detach() for t in tensors]


def _on(averaged: list[Tensor], current: list[Tensor]) -> list[Tensor]:
    """`current`, each on its average's device (`device=` may keep the average elsewhere)."""
    return [value.to(into.device) for into, value in zip(averaged, current, strict=True)]


def _ema(averaged: list[Tensor], current: list[Tensor], decay: float) -> None:
    """`averaged <- decay * averaged + (1 - decay) * current`, in place: one foreach lerp for the floating
    tensors (torch's `get_ema_multi_avg_fn`), torch's per-tensor formula for the others (integer buffers)."""
    floats = [(a, c) for a, c in zip(averaged, current) if a.is_floating_point() or a.is_complex()]
    if floats:
        torch._foreach_lerp_([a for a, _ in floats], [c for _, c in floats], 1.0 - decay)
    for into, value in zip(averaged, current):
        if not (into.is_floating_point() or into.is_complex()):
            into.copy_(into * decay + value * (1 - decay))
