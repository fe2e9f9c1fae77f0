"""The non-finite-loss guard: a NaN/inf training loss never updates the weights, decided on the device."""

from __future__ import annotations

import logging
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor

log = logging.getLogger(__name__)


def at_log_write(trainer: L.Trainer) -> bool:
    """Whether Lightning writes the logs after this optimizer step (every `log_every_n_steps`), where the
    logger reads its values back anyway: the one place a callback's per-step state may be read too. The
    same step on every DDP rank, so a collective here is met by all of them."""
    return trainer.global_step % max(trainer.log_every_n_steps, 1) == 0


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite (`NonFiniteLossGuard(action="stop")`)."""


class NonFiniteLossGuard(L.Callback):
    """Never apply an optimizer step whose loss is NaN or infinite.

    `action="stop"` raises `NonFiniteLossError` naming the first such step, whose update (and any after it)
    never touches the weights. `action="skip"` drops the step's update (the optimizer leaves every weight and
    its moments unchanged; the learning-rate schedule still advances), counts it in `train/skipped_steps`
    and stops the same way after `max_consecutive_skips` skipped steps in a row. Under 16-mixed the
    GradScaler already skips steps whose *gradients* overflow (and lowers the scale): that is loss
    scaling at work, not a fault; this guard looks at the loss itself. Under DDP one rank's bad loss skips
    (or stops) the step on every rank: the ranks' flags meet in a device all-reduce, never read back.

    The decision and the counts stay on the device. An optimizer that can skip its own update there (fused
    AdamW reads the `found_inf` flag that torch's GradScaler sets; the project's default on CPU and CUDA,
    under 32-true and bf16-mixed with or without clipping) gets the flag, and the guard reads its state
    back only when Lightning writes the logs (`at_log_write`), at the end of an epoch, before validation
    and before a checkpoint is saved: a stop then comes a few (no-op) steps late, still naming the first
    bad step, with the weights of the step before it. Any other optimizer (or a GradScaler, which owns the
    flag: 16-mixed) costs one read per step: the guard drops the gradients of a bad step and stops before
    the optimizer runs.
    """

    def __init__(self, action: Literal["skip", "stop"] = "stop", max_consecutive_skips: int = 10) -> None:
        if action not in ("skip", "stop"):
            raise ValueError(f"action must be 'skip' or 'stop', got {action!r}")
        if isinstance(max_consecutive_skips, bool) or not (
            isinstance(max_consecutive_skips, int) and max_consecutive_skips >= 1
        ):
            raise ValueError(f"max_consecutive_skips must be an integer >= 1, got {max_consecutive_skips!r}")
        self.action = action
        self.max_consecutive_skips = max_consecutive_skips
        self._state: Tensor | None = None  # on the device: skipped, consecutive, halt step, loss, epoch
        self._loss: Tensor | None = None  # this step's first non-finite loss (NaN-safe), else 0
        self._bad: Tensor | None = None  # this step's micro-batches saw a non-finite loss (device bool)
        self._reported_skips = 0
        self._checked_step = -1
        self._loaded = (0, 0)  # (skipped, consecutive) from a checkpoint, until the device state exists

    # the device state: one float32 vector (exact counts up to 2^24 steps), read back in one go
    _SKIPPED, _CONSECUTIVE, _HALT_STEP, _HALT_LOSS, _HALT_EPOCH = range(5)

    def _vector(self, device: torch.device) -> Tensor:
        if self._state is None:
            self._state = torch.tensor([*self._loaded, 0.0, 0.0, 0.0], dtype=torch.float32, device=device)
        return self._state

    @property
    def skipped(self) -> int:
        """Steps skipped so far (reads the device)."""
        return int(self._state[self._SKIPPED]) if self._state is not None else self._loaded[0]

    @property
    def consecutive(self) -> int:
        """Steps skipped in a row up to the last one (reads the device)."""
        return int(self._state[self._CONSECUTIVE]) if self._state is not None else self._loaded[1]

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        value = loss.detach().float().sum()
        bad = ~torch.isfinite(value)
        self._vector(value.device)
        if self._bad is None:  # the step's first micro-batch
            self._bad, self._loss = bad, torch.where(bad, value, 0.0)
        else:  # keep the first bad micro-batch's loss
            self._loss = torch.where(self._bad, self._loss, torch.where(bad, value, 0.0))
            self._bad = self._bad | bad

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        bad, loss = self._bad, self._loss
        self._bad = self._loss = None
        if bad is None:  # no backward pass this step (a closure that returned None)
            return
        if trainer.world_size > 1 and torch.distributed.is_initialized():  # one rank's bad loss: every rank's
            shared = bad.to(torch.int32)
            torch.distributed.all_reduce(shared, op=torch.distributed.ReduceOp.MAX)
            bad = shared.bool()
        state = self._vector(bad.device)
        halted = state[self._HALT_STEP] > 0
        skipped = bad & ~halted
        state[self._SKIPPED] += skipped.float()
        state[self._CONSECUTIVE] = torch.where(bad, state[self._CONSECUTIVE] + 1, 0.0)
        if self.action == "stop":
            halts = bad & ~halted
        else:
            halts = (state[self._CONSECUTIVE] >= self.max_consecutive_skips) & ~halted
        step = trainer.global_step + 1  # the optimizer step being taken (1-based)
        state[self._HALT_STEP] = torch.where(halts, float(step), state[self._HALT_STEP])
        state[self._HALT_LOSS] = torch.where(halts, loss, state[self._HALT_LOSS])
        state[self._HALT_EPOCH] = torch.where(halts, float(trainer.current_epoch), state[self._HALT_EPOCH])
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the torch one
        if self._skips_on_device(trainer, inner):
            inner.found_inf = (bad | halted).float()  # the fused kernel leaves weights, moments, step counts
            return
        if self.check(trainer):  # one read: raises if this step halted, True if it is skipped
            for group in inner.param_groups:
                for param in group["params"]:
                    param.grad = None  # torch optimizers leave parameters without gradients untouched

    @staticmethod
    def _skips_on_device(trainer: L.Trainer, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer skips a step on a device flag (fused kernels), and no GradScaler sets that flag."""
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return scaler is None and getattr(optimizer, "_step_supports_amp_scaling", False)

    def check(self, trainer: L.Trainer) -> bool:
        """Read the device state back (one read): warn about newly skipped steps, raise if the run halted.
        Returns whether the last step was skipped."""
        if self._state is None:
            return False
        self._checked_step = trainer.global_step
        skipped, consecutive, halt_step, halt_loss, epoch = self._state.tolist()
        if skipped > self._reported_skips:
            log.warning(
                "non-finite training loss: step skipped (%d up to optimizer step %d, %d skipped so far)",
                skipped - self._reported_skips,
                trainer.global_step,
                skipped,
            )
            self._reported_skips = int(skipped)
        if halt_step <= 0:
            return consecutive > 0
        where = f"training loss is {halt_loss} at optimizer step {int(halt_step)} (epoch {int(epoch)})"
        hint = "lower model.optimizer.lr, raise warmup, or check the data"
        if self.action == "stop":
            raise NonFiniteLossError(f"{where}: stopped before updating the weights ({hint})")
        raise NonFiniteLossError(
            f"{where}: {self.max_consecutive_skips} steps in a row skipped "
            f"(max_consecutive_skips={self.max_consecutive_skips}), stopping ({hint})"
        )

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._state is not None:
            pl_module.log(
                "train/skipped_steps", self._state[self._SKIPPED], on_step=True, on_epoch=False, batch_size=1
            )
        if at_log_write(trainer) and trainer.global_step != self._checked_step:
            self.check(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.training:  # fit's validation
            self.check(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer)

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.training:  # a halted run saves nothing
            self.check(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = (int(state_dict.get("skipped", 0)), int(state_dict.get("consecutive", 0)))
        self._reported_skips = self._loaded[0]
        self._state = None
