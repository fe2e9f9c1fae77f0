"""Crash-safe training: atomic checkpoint files, a checkpoint on SIGTERM / SIGINT, exact random state on
resume, a guard that never lets a NaN/inf loss update the weights, and a CSV logger that keeps the rows
of the run it continues.

Wired in by configs/trainer/default.yaml (`plugins`) and configs/callbacks/default.yaml; the README's
"Reliability" section lists what each piece promises and the test that checks it.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import random
import re
import signal
import socket
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn

log = logging.getLogger(__name__)

__all__ = [
    "AtomicCheckpointIO",
    "CSVLogger",
    "NonFiniteLossError",
    "NonFiniteLossGuard",
    "RandomState",
    "SaveOnSignal",
]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file in its own directory, fsync it, then `os.replace` it.

    Lightning's default (`_atomic_save` through an fsspec transaction) writes the temporary file in
    the system temp dir and `shutil.move`s it: across filesystems that is a copy into the final name,
    so a kill during the copy leaves a truncated `last.ckpt`, and the temp file leaks. Here the rename
    stays on one filesystem and is atomic: a reader sees the old file or the new one, never a part.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = Path(path)
        if "://" in str(path):  # remote filesystems: their own upload semantics
            return super().save_checkpoint(checkpoint, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if "://" not in str(path):  # resuming after a kill: clear what the killed save left next to it
            remove_stale_temp_files(Path(path).parent)
        return super().load_checkpoint(path, *args, **kwargs)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """`torch.save(obj, path)` that leaves either the old file or the complete new one at `path`.

    The temporary file is `.{name}.{host}.{pid}.XXXX.tmp` beside `path`; one left by a killed writer is
    removed by the next save into the directory (`remove_stale_temp_files`).
    """
    remove_stale_temp_files(path.parent)
    prefix = f".{path.name}.{_HOST}.{os.getpid()}."
    fd, tmp_name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp_name, 0o666 & ~_umask())  # mkstemp creates 0600; a checkpoint is an ordinary file
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself survives a power cut


_HOST = socket.gethostname().replace(".", "_") or "localhost"
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.[^.]+\.tmp$")


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete the temporary files of `atomic_torch_save` in `directory` whose writer is dead: written on
    this host by a process that no longer exists (a SIGKILL or power loss during a save). Files of live
    processes and of other hosts (a shared filesystem) are left alone. Returns what was removed."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None or match["host"] != _HOST or _process_alive(int(match["pid"])):
            continue
        try:
            entry.unlink()
        except OSError:  # gone already, or not ours to delete: harmless
            continue
        removed.append(entry)
        log.info("removed %s, left by a save that was killed", entry)
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class SaveOnSignal(L.Callback):
    """On SIGTERM (SLURM preemption, `kill`) or SIGINT (Ctrl-C): finish the current training step, write
    a resumable checkpoint to `dirpath/filename.ckpt`, then exit with status 128 + signal number.

    Lightning 2.6 on a plain SIGTERM stops after the step without saving anything, and on SIGINT
    raises KeyboardInterrupt wherever the program is (possibly mid optimizer step). This callback
    replaces both handlers for the duration of training with one that only sets a flag; the flag is
    acted on at the end of a training step, where the state is consistent (the same point where
    `every_n_train_steps` checkpoints are taken, so resuming is exact). A second signal of the same
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
        self._exit_if_saved()

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

    def _exit_if_saved(self, *args: Any) -> None:
        if self._exit_code is not None:
            code, self._exit_code = self._exit_code, None
            raise SystemExit(code)

    on_train_batch_start = on_validation_start = on_train_epoch_end = _exit_if_saved

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handlers()
        self._exit_if_saved()


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class RandomState(L.Callback):
    """Store the Python, NumPy and torch (CPU and CUDA) random states in every checkpoint and restore
    them on resume, so that dropout after a resume draws what the uninterrupted run drew."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": _numpy_state_plain(np.random.get_state()),
            "python": _python_state_plain(random.getstate()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        np.random.set_state(_numpy_state(state_dict["numpy"]))
        random.setstate(_python_state(state_dict["python"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])


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

    `action="stop"` raises `NonFiniteLossError` naming the step before the optimizer touches the
    weights. `action="skip"` drops the step's gradients (the optimizer leaves every weight and its
    moments unchanged; the learning-rate schedule still advances), counts it in `train/skipped_steps`
    and stops the same way after `max_consecutive_skips` skipped steps in a row. Under 16-mixed the
    GradScaler already skips steps whose *gradients* overflow (and lowers the scale): that is loss
    scaling at work, not a fault; this guard looks at the loss itself.
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
        self.skipped = 0
        self.consecutive = 0
        self._bad_loss: float | None = None

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        value = float(loss.detach().float().sum())
        if not math.isfinite(value) and self._bad_loss is None:  # first bad micro-batch of the step
            self._bad_loss = value

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        bad = self._bad_loss is not None
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        loss, self._bad_loss = self._bad_loss, None
        if not bad:
            self.consecutive = 0
            return
        step = trainer.global_step + 1  # the optimizer step being taken (1-based)
        where = f"training loss is {loss} at optimizer step {step} (epoch {trainer.current_epoch})"
        hint = "lower model.optimizer.lr, raise warmup, or check the data"
        if self.action == "stop":
            raise NonFiniteLossError(f"{where}: stopped before updating the weights ({hint})")
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive_skips:
            raise NonFiniteLossError(
                f"{where}: {self.consecutive} steps in a row skipped "
                f"(max_consecutive_skips={self.max_consecutive_skips}), stopping ({hint})"
            )
        log.warning("%s: step skipped (%d skipped so far)", where, self.skipped)
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None  # torch optimizers leave parameters without gradients untouched

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pl_module.log("train/skipped_steps", float(self.skipped), on_step=True, on_epoch=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
        self.consecutive = int(state_dict.get("consecutive", 0))


class CSVLogger(LightningCSVLogger):
    """Lightning's CSV logger, except that a run continued in its own directory keeps that directory's
    `metrics.csv` (Lightning's deletes it): the rows of the steps before the ones this run logs stay,
    the later ones (logged by the earlier run after its checkpoint, and logged again now) are replaced.
    """

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(log_dir=self.log_dir)
        return self._experiment


class _ContinuingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:  # called by __init__ instead of deleting the earlier file
        self._earlier: list[dict[str, str]] | None = None
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            self._earlier = list(reader)
            self.metrics_keys = sorted(reader.fieldnames or [])

    def save(self) -> None:
        if self._earlier is not None and self.metrics:
            first_step = min(int(m["step"]) for m in self.metrics)
            kept = [row for row in self._earlier if int(float(row["step"])) < first_step]
            with self._fs.open(self.metrics_file_path, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(kept)
            self._earlier = None
        super().save()
