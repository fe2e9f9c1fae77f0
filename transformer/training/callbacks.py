"""Callbacks of a crash-safe run: a checkpoint on SIGTERM / SIGINT, exact random state on resume; and a
progress bar that does not make each training step wait for the device; a model summary without the
FLOPs it cannot count. The non-finite-loss guard
(`loss_guard.py`) and the EMA of the weights (`averaging.py`) have their own modules; their names here
keep older `_target_` paths and imports working."""

from __future__ import annotations

import logging
import random
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.callbacks import RichProgressBar as _LightningRichProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

from transformer.training.averaging import EMAWeightAveraging
from transformer.training.lightning_private import (
    accumulating,
    forget_launched_ranks,
    replace_sigterm_broadcast,
    val_batch_progress,
)
from transformer.training.loss_guard import NonFiniteLossError, NonFiniteLossGuard, at_log_write

__all__ = [
    "EMAWeightAveraging",
    "ModelSummary",
    "NonFiniteLossError",
    "NonFiniteLossGuard",
    "RandomState",
    "RichProgressBar",
    "SaveOnSignal",
]

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
    kind exits at once. Under DDP the ranks agree on stopping at the next step where Lightning writes the
    logs (`log_every_n_steps`): the agreement (an all-reduce of a flag, read back) would make every step
    wait for the devices.

    A signal during validation (which can take minutes when it decodes for BLEU) is acted on after
    the validation batch in flight, without waiting for validation to end: the training state is
    that of the last training step, and the checkpoint marks the validation as interrupted, so the
    resumed run first reruns that validation from its start (Lightning's restart mid-evaluation)
    and then trains on. Under DDP, where ranks may hold different numbers of validation batches, the
    signal is acted on at the next log write in training, as above.
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
        _thin_lightnings_sigterm_broadcast(trainer)
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
        if accumulating(trainer):  # mid-window: the summed gradient is not saved
            return  # (the same on every rank) so act at the window's optimizer step, where resuming is exact
        received = self.received is not None
        if trainer.world_size > 1:
            if not at_log_write(trainer):  # the ranks' agreement reads a flag back: a wait for every device
                return
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
        progress = val_batch_progress(checkpoint)
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


def _thin_lightnings_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Under DDP, Lightning 2.6's training loop broadcasts rank 0's SIGTERM flag before every batch and
    reads it back (`_TrainingEpochLoop._broadcast_sigterm_tensor`): a wait for every device, each step,
    for a flag that only Lightning's own SIGTERM handler sets, replaced by `SaveOnSignal`'s during
    training. Keep it at the batches after a log write (the same batches on every rank, so the
    collective still pairs up), where a SIGTERM that reached Lightning's handler before training still
    stops the run."""
    replace_sigterm_broadcast(
        trainer, lambda: bool(trainer.global_step) and at_log_write(trainer)
    )  # after a step that wrote the logs


def _unwatch_the_other_ranks(trainer: L.Trainer) -> None:
    """On the process that started the other DDP ranks (Lightning's subprocess launcher: `trainer=ddp_cpu`,
    `trainer=ddp` without srun), stop Lightning's watch over them before exiting with them: its thread
    SIGKILLs this process when another rank exits with a non-zero status, so that this process would end
    as 137 instead of 143 whenever it takes longer than the others to wind down (its loggers finishing).
    The thread watches the launcher's own list of processes, emptied here."""
    forget_launched_ranks(trainer)


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


class RichProgressBar(_LightningRichProgressBar):
    """Lightning's rich progress bar, plus the task's `progress_values` (the training loss and tokens/s),
    which it reads back once per `log_every_n_steps` instead of after every batch.

    Where the output is no terminal (`nohup`, `> train.out`, a cluster job's log), rich draws the bar only
    when training ends. There the bar logs plain lines instead, as fairseq's `--log-format simple` does:
    one every `log_every_s` seconds of training (epoch, batch, step, the bar's values, time so far) and one
    after each validation with its metrics. The values are those already read back for the bar, so the
    lines add no wait for the device. `log_every_s: 0` writes a line after every batch."""

    def __init__(self, *args: Any, log_every_s: float = 60.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not log_every_s >= 0:
            raise ValueError(f"callbacks.rich_progress_bar.log_every_s: seconds >= 0, got {log_every_s}")
        self.log_every_s = log_every_s
        self._started = self._last_line = 0.0  # when training started and the last line went (monotonic)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        values = getattr(pl_module, "progress_values", None)
        return {**super().get_metrics(trainer, pl_module), **(values.read() if values is not None else {})}

    @property
    def plain(self) -> bool:
        """Lines to the log instead of a bar: the bar is on and its console is no terminal."""
        return self.is_enabled and self._console is not None and not self._console.is_terminal

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._started = self._last_line = time.monotonic()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        now = time.monotonic()
        if not self.plain or now - self._last_line < self.log_every_s:
            return
        self._last_line = now
        shown = {
            k: v
            for k, v in self.get_metrics(trainer, pl_module).items()
            if k != "v_num" and not k.startswith("val/")
        }
        batches = trainer.num_training_batches
        of_batches = f"/{batches}" if batches != float("inf") else ""
        log.info(
            "%s · batch %d%s · step %d%s · %s elapsed",
            _epoch(trainer),
            batch_idx + 1,
            of_batches,
            trainer.global_step,
            "".join(f" · {k} {_number(v)}" for k, v in shown.items()),
            _clock(now - self._started),
        )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self.plain or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        log.info(
            "%s validated at step %d:%s",
            _epoch(trainer),
            trainer.global_step,
            "".join(f" {k} {_number(v)}" for k, v in sorted(metrics.items())),
        )


def _epoch(trainer: L.Trainer) -> str:
    last = trainer.max_epochs
    return f"epoch {trainer.current_epoch + 1}" + (f"/{last}" if last is not None and last > 0 else "")


def _number(value: Any) -> str:
    value = float(value.item() if isinstance(value, torch.Tensor) else value)
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"


class ModelSummary(RichModelSummary):
    """Lightning's rich model summary without its FLOPs column and total: Lightning counts FLOPs only
    on a module's `example_input_array`, which a task of variable-length batches has not, so it printed
    0 for every layer and "Total FLOPs: 0"."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs: Any,
    ) -> None:
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            right = name not in (" ", "Name", "Type", "Mode")
            table.add_column(name, justify="right" if right else "left", style="dim" if name == " " else None)
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        grid = Table.grid(expand=True)
        lines = {
            "Trainable params": get_human_readable_count(int(trainable_parameters)),
            "Non-trainable params": get_human_readable_count(int(total_parameters - trainable_parameters)),
            "Total params": get_human_readable_count(int(total_parameters)),
            "Total estimated model params size (MB)": get_formatted_model_size(model_size),
            "Modules in train mode": total_training_modes["train"],
            "Modules in eval mode": total_training_modes["eval"],
        }
        for label, value in lines.items():
            grid.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(grid)
