"""Checkpoint files that are never half-written: atomic saves (a temporary file, fsync, rename) and the
clean-up of temporary files that a killed process left behind."""

from __future__ import annotations

import logging
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from transformer.disk import human_size, room_for, tensor_bytes, writing
from transformer.training.lightning_private import PATH

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file in its own directory, fsync it, then `os.replace` it.

    Lightning's default (`_atomic_save` through an fsspec transaction) writes the temporary file in
    the system temp dir and `shutil.move`s it: across filesystems that is a copy into the final name,
    so a kill during the copy leaves a truncated `last.ckpt`, and the temp file leaks. Here the rename
    stays on one filesystem and is atomic: a reader sees the old file or the new one, never a part.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = Path(path)
        if "://" in str(path):  # remote filesystems: their own upload semantics
            return super().save_checkpoint(checkpoint, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if "://" not in str(path):  # resuming after a kill: clear what the killed save left next to it
            remove_stale_temp_files(Path(path).parent)
        return super().load_checkpoint(path, *args, **kwargs)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """`torch.save(obj, path)` that leaves either the old file or the complete new one at `path`.

    The temporary file is `.{name}.{host}.{pid}.XXXX.tmp` beside `path`; one left by a killed writer is
    removed by the next save into the directory (`remove_stale_temp_files`).
    """
    remove_stale_temp_files(path.parent)
    with writing(path, f"the checkpoint of {human_size(tensor_bytes(obj))}"):
        _save_through_temp_file(obj, path)
    _fsync_dir(path.parent)  # the rename itself survives a power cut


def _save_through_temp_file(obj: Any, path: Path) -> None:
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


def check_room_for_checkpoint(trainer: L.Trainer, task: L.LightningModule) -> None:
    """Before the first step: refuse (the full-disk OSError of `transformer.disk.room_for`) when the
    filesystem of a checkpoint directory cannot hold even one checkpoint: the task's weights and buffers
    plus its optimizer's state (2 tensors per trainable parameter for the Adam family, 1 for SGD with
    momentum, none counted for others: a lower bound, so a run that fits is never refused)."""
    directories = {
        Path(callback.dirpath)
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint) and callback.dirpath and "://" not in str(callback.dirpath)
    }
    if not directories:
        return
    weights = tensor_bytes(task.state_dict())
    trainable = tensor_bytes([p for p in task.parameters() if p.requires_grad])
    state = _optimizer_slots(getattr(task, "optimizer_factory", None)) * trainable
    needed = weights + state
    what = f"the first checkpoint of {human_size(needed)} (weights {human_size(weights)}"
    what += f", optimizer state {human_size(state)}), checked before the first step" if state else ")"
    for directory in sorted(directories):
        room_for(directory, needed, what)


def _optimizer_slots(factory: Any) -> int:
    """Tensors of optimizer state per trainable parameter, from the optimizer factory's name."""
    name = getattr(getattr(factory, "func", factory), "__name__", "").lower()
    if "adam" in name:
        return 2
    momentum = getattr(factory, "keywords", {}).get("momentum") if "sgd" in name else None
    return 1 if momentum else 0


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
