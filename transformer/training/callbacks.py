"""Callbacks of a crash-safe run: a checkpoint on SIGTERM / SIGINT, exact random state on resume, a guard
that never lets a NaN/inf loss update the weights, and the EMA of the weights evaluated the way it was
selected; and a progress bar that does not make each training step wait for the device."""

from __future__ import annotations

import logging
import random
import signal
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging as _LightningEMA
from lightning.pytorch.callbacks import RichProgressBar as _LightningRichProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

log = logging.getLogger(__name__)


class SaveOnSignal(L.Callback):
    """On SIGTERM (SLURM preemption, `kill`) or SIGINT (Ctrl-C): finish the current training step, write
    a resumable checkpoint to `dirpath/filename.ckpt`, then exit with status 128 + signal number.

    Lightning 2.6 on a plain SIGTERM stops after the step without saving anything, and on SIGINT
    raises KeyboardInterrupt wherever the program is (possibly mid optimizer step). This callback
    replaces both handlers for the duration of training with one that only sets a flag; the flag is
    acted on at the end of a training step, where the state is consistent (the same point where
    `every_n_train_steps` checkpoints are taken, so resuming is exact; with accumulate_grad_batches > 1,
    at the end of the accumulation window). A second signal of the same
    kind exits at once. Under DDP the ranks agree on stopping (one all-reduce of a flag per step).

    A signal during validation (which can take minutes when it decodes for BLEU) is acted on after
    the validation batch in flight, without waiting for validation to end: the training state is
    that of the last training step, and the checkpoint marks the validation as interrupted, so the
    resumed run first reruns that validation from its start (Lightning's restart mid-evaluation)
    and then trains on. Under DDP, where ranks may hold different numbers of validation batches, the
    signal is acted on after the next training step as above.
    """

    def __init__(
        self, dirpath: str | Path, filename: str = "last", signals: tuple[str, ...] = ("SIGTERM", "SIGINT")
    ) -> None:
        self.path = Path(dirpath) / f"{filename}.ckpt"
        self.signals = tuple(signal.Signals[name] for name in signals)
        self.received: signal.Signals | None = None
        self._exit_code: int | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._mid_validation = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and self.received == signum:  # asked twice: stop now
            raise SystemExit(128 + signum)
        self.received = signal.Signals(signum)
        log.warning("Received %s: saving a checkpoint after this training step", self.received.name)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received = None
        if not _in_main_thread():
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.fit_loop.epoch_loop._should_accumulate():  # mid-window: the summed gradient is not saved
            return  # (the same on every rank) so act at the window's optimizer step, where resuming is exact
        received = self.received is not None
        if trainer.world_size > 1:
            received = trainer.strategy.reduce_boolean_decision(received, all=False)
        if not received or self._exit_code is not None:
            return
        self._save(trainer)  # exit at the next hook, once the loop has logged this step's metrics

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.received is None or trainer.sanity_checking or trainer.world_size > 1 or not fitting:
            return
        self._mid_validation = True
        try:
            self._save(trainer, "during validation")
        finally:
            self._mid_validation = False
        self._exit_if_saved(trainer)

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self._mid_validation:
            return
        # Mark the batch just validated as started but not processed: on resume Lightning then sees an
        # interrupted validation and runs it again from the start before training on (its progress
        # counters are the only thing that differs from a save right after the training step).
        progress = checkpoint["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]
        for counts in (progress["total"], progress["current"]):
            counts["processed"] = counts["completed"] = counts["started"] - 1

    def _save(self, trainer: L.Trainer, when: str = "") -> None:
        name = self.received.name if self.received is not None else "a signal (on another rank)"
        trainer.save_checkpoint(self.path)
        log.warning(
            "%s%s: saved %s at step %d; resume with ckpt_path=%s",
            name,
            f" {when}" if when else "",
            self.path,
            trainer.global_step,
            self.path,
        )
        self._exit_code = 128 + (int(self.received) if self.received is not None else int(signal.SIGTERM))

    def _exit_if_saved(self, trainer: L.Trainer, *args: Any) -> None:
        if self._exit_code is not None:
            code, self._exit_code = self._exit_code, None
            _unwatch_the_other_ranks(trainer)
            raise SystemExit(code)

    on_train_batch_start = on_validation_start = on_train_epoch_end = _exit_if_saved

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handlers()
        self._exit_if_saved(trainer)


def _unwatch_the_other_ranks(trainer: L.Trainer) -> None:
    """On the process that started the other DDP ranks (Lightning's subprocess launcher: `trainer=ddp_cpu`,
    `trainer=ddp` without srun), stop Lightning's watch over them before exiting with them: its thread
    SIGKILLs this process when another rank exits with a non-zero status, so that this process would end
    as 137 instead of 143 whenever it takes longer than the others to wind down (its loggers finishing).
    The thread watches the launcher's own list of processes, emptied here."""
    children = getattr(trainer.strategy.launcher, "procs", None)
    if children:
        children.clear()


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class RandomState(L.Callback):
    """Store the Python, NumPy and torch (CPU and CUDA) random states in every checkpoint and restore
    them on resume, so that dropout after a resume draws what the uninterrupted run drew.

    Under DDP each rank draws its own numbers (dropout on its own batches) and only rank 0 writes the
    checkpoint, so the states of every rank are gathered into it (every rank takes part in a save) and
    each rank restores its own; resumed with another number of processes, every rank takes rank 0's.
    """

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": _numpy_state_plain(np.random.get_state()),
            "python": _python_state_plain(random.getstate()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        if _world_size() > 1:
            ranks: list[Any] = [None] * _world_size()
            torch.distributed.all_gather_object(ranks, state)
            state = {**state, "ranks": ranks}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ranks = state_dict.get("ranks", [])
        if len(ranks) == _world_size() > 1:
            state_dict = ranks[torch.distributed.get_rank()]
        torch.set_rng_state(state_dict["torch"])
        np.random.set_state(_numpy_state(state_dict["numpy"]))
        random.setstate(_python_state(state_dict["python"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])


def _world_size() -> int:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_world_size() if distributed else 1


# the states as plain tensors / lists / ints, so that checkpoints keep loading with weights_only=True
def _numpy_state_plain(state: tuple) -> list[Any]:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]


def _numpy_state(plain: list[Any]) -> tuple:
    name, keys, pos, has_gauss, cached = plain
    return name, keys.numpy().astype(np.uint32), pos, has_gauss, cached


def _python_state_plain(state: tuple) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_state(plain: list[Any]) -> tuple:
    version, internal, gauss = plain
    return version, tuple(internal), gauss


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
    (or stops) the step on every rank.

    The decision and the counts stay on the device. An optimizer that can skip its own update there (fused
    AdamW reads the `found_inf` flag that torch's GradScaler sets; the project's default on CPU and CUDA)
    gets the flag, and the guard reads its state back only when Lightning writes the logs
    (`log_every_n_steps`), at the end of an epoch, before validation and before a checkpoint is saved: a
    stop then comes a few (no-op) steps late, still naming the first bad step, with the weights of the
    step before it. Any other optimizer (or a GradScaler, which owns the flag) costs one read per step:
    the guard drops the gradients of a bad step and stops before the optimizer runs.
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
        step = trainer.global_step
        if step % max(trainer.log_every_n_steps, 1) == 0 and step != self._checked_step:  # logs are written
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
    """

    def __init__(
        self, device: torch.device | str | int | None = None, use_buffers: bool = False, **kwargs: Any
    ) -> None:  # Lightning's signature, its other default
        super().__init__(device, use_buffers, **kwargs)

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)


class RichProgressBar(_LightningRichProgressBar):
    """Lightning's rich progress bar, plus the task's `progress_values` (the training loss and tokens/s),
    which it reads back once per `log_every_n_steps` instead of after every batch."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        values = getattr(pl_module, "progress_values", None)
        return {**super().get_metrics(trainer, pl_module), **(values.read() if values is not None else {})}
