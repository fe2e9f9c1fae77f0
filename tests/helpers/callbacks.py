"""Test-only Lightning callbacks that train.py runs load by `_target_`: signals, NaN losses, a record."""

from __future__ import annotations

import hashlib
import os
import signal
from typing import Any

import lightning as L
import torch


class SignalAtStep(L.Callback):
    """Send this process `signal` once, at the end of optimizer step `step` (a real signal, known moment)."""

    def __init__(self, step: int, signal: str) -> None:
        self.step, self.signal = step, signal

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), getattr(signal, self.signal))


class SignalAtBatch(L.Callback):
    """Send this process `signal` once, at the end of training batch `batch` (0-based, whole run): with
    gradient accumulation, possibly in the middle of an accumulation window."""

    def __init__(self, batch: int, signal: str) -> None:
        self.batch, self.signal, self.seen = batch, signal, 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen += 1
        if self.seen == self.batch + 1:
            os.kill(os.getpid(), getattr(signal, self.signal))


class SignalDuringValidation(L.Callback):
    """Send this process `signal` once, as validation batch `batch` of epoch `epoch` starts."""

    def __init__(self, epoch: int, batch: int, signal: str) -> None:
        self.epoch, self.batch, self.signal = epoch, batch, signal

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int, *args: Any
    ) -> None:
        if not trainer.sanity_checking and trainer.current_epoch == self.epoch and idx == self.batch:
            os.kill(os.getpid(), getattr(signal, self.signal))


class PoisonSteps(L.Callback):
    """Make the loss NaN at the given optimizer steps (1-based) by filling one weight with NaN during
    that step only: any weight update it let through would show up as a change or a NaN."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)
        self._saved: torch.Tensor | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step + 1 in self.steps:
            weight = next(pl_module.parameters())
            self._saved = weight.detach().clone()
            with torch.no_grad():
                weight.fill_(float("nan"))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._saved is not None:
            with torch.no_grad():
                next(pl_module.parameters()).copy_(self._saved)
            self._saved = None


class RecordStop(L.Callback):
    """Write to `path`, when training stops on an exception, a digest of the weights and optimizer state at
    that moment, before training and after every training step that ended (by global step)."""

    def __init__(self, path: str) -> None:
        self.path, self.steps = path, {}

    @staticmethod
    def _state(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        def digest(tensor: torch.Tensor) -> str:
            data = tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
            return hashlib.sha256(data.numpy()).hexdigest()

        return {
            "global_step": trainer.global_step,
            "weights": {k: digest(v) for k, v in pl_module.state_dict().items()},
            "optimizer": {
                f"{index}.{key}": digest(value)
                for index, state in trainer.optimizers[0].state_dict()["state"].items()
                for key, value in state.items()
            },
        }

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps[trainer.global_step] = self._state(trainer, pl_module)

    on_train_batch_end = on_train_start

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        torch.save({"steps": self.steps, "at_error": self._state(trainer, pl_module)}, self.path)
