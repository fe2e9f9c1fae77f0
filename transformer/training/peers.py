"""A DDP run that loses one of its processes (a node killed or rebooted, a process out of memory, a frozen
or unreachable node): the survivors stop with one line naming what happened and the checkpoint to resume
from, instead of a traceback from inside the collective that noticed."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

from transformer.training.callbacks import SaveOnSignal
from transformer.training.lightning_private import process_group_timeout

__all__ = ["PeerLostError", "lost_peer_cause", "peer_lost_line", "stop_on_lost_peer"]


class PeerLostError(RuntimeError):
    """Another process of this DDP run went away or stopped answering: one line, exit status 1."""


# What the backends say when the other end of a collective is gone: gloo's TCP pairs (a closed socket is
# noticed at once, a silent peer after the process group's timeout), NCCL's aborted communicators and
# watchdog, the rendezvous store. `torch.distributed.DistError` (backend, network, store) is one too.
_LOST = re.compile(
    r"gloo/|connection (reset|closed|refused)|broken pipe|pair closure|timed out waiting|"
    r"communicator was aborted",
    re.IGNORECASE,
)
_DIST_ERRORS = getattr(torch.distributed, "DistError", ())  # absent where torch has no distributed package
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
# gloo prefixes its messages with its source file and appends generic advice
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|h)(:\d+)?\]\s*")
_ADVICE = re.compile(r"\.?\s*This is typically caused by.*$", re.IGNORECASE)


def lost_peer_cause(err: BaseException) -> str | None:
    """The backend's own words if `err` is a collective failing because another process went away or did
    not answer in time (the first line, without gloo's source-file prefix and advice), else None."""
    if not isinstance(err, RuntimeError):
        return None
    text = " ".join(str(err).strip().splitlines()[:1]) if str(err).strip() else ""
    if not isinstance(err, _DIST_ERRORS) and not _LOST.search(text):
        return None
    return _ADVICE.sub("", _SOURCE_PREFIX.sub("", text)).strip().rstrip(".") or type(err).__name__


def peer_lost_line(
    cause: str,
    step: int,
    world_size: int,
    checkpoint: Path | None,
    checkpoint_step: int | None,
    timeout: timedelta | None,
    joined: bool = True,
) -> str:
    """The one line: what happened (the backend's words), at which step, and where to resume from; or,
    when the processes never all `joined`, that they did not."""
    waited = ""
    if timeout is not None and _TIMED_OUT.search(cause):
        waited = f", no answer within trainer.strategy.timeout ({timeout.total_seconds():g} s)"
    if not joined:
        return (
            f"training could not start: not every process of this {world_size}-process DDP run joined "
            f"({cause}{waited}); every node runs the same command with the same MASTER_ADDR and MASTER_PORT "
            "and a NODE_RANK of its own (docs/cluster.md)"
        )
    what = (
        f"training stopped at step {step}: another process of this {world_size}-process DDP run was lost "
        f"({cause}{waited})"
    )
    if checkpoint is None:
        return (
            f"{what}; no checkpoint had been written yet, so the run starts over "
            "(callbacks.last_checkpoint.every_n_train_steps=N writes one every N steps)"
        )
    at = f" (step {checkpoint_step})" if checkpoint_step is not None else ""
    return f"{what}; the last checkpoint written is {checkpoint}{at}: resume with ckpt_path={checkpoint}"


@contextlib.contextmanager
def stop_on_lost_peer(trainer: L.Trainer) -> Iterator[None]:
    """Around `trainer.fit` / `trainer.test`: a collective that fails because another DDP process is gone
    (or the start, because one never came) becomes `PeerLostError` with the one line (Lightning has
    already run its exception hooks and teardown: loggers finalized, signal handlers restored). This
    process writes nothing more: its state may be in the middle of a step, and saving it needs the lost
    process (the random states of every rank are gathered into a checkpoint), so the line names the
    newest checkpoint on disk instead."""
    try:
        yield
    except RuntimeError as err:
        cause = lost_peer_cause(err) if trainer.world_size > 1 else None
        if cause is None:
            raise
        backend = getattr(trainer.strategy, "process_group_backend", None)
        checkpoint = last_written_checkpoint(trainer)
        line = peer_lost_line(
            f"{backend}: {cause}" if backend else cause,
            trainer.global_step,
            trainer.world_size,
            checkpoint,
            _checkpoint_step(checkpoint),
            process_group_timeout(trainer.strategy),
            joined=torch.distributed.is_available() and torch.distributed.is_initialized(),
        )
        raise PeerLostError(line) from err


def last_written_checkpoint(trainer: L.Trainer) -> Path | None:
    """The newest `.ckpt` in the directories the run's checkpoint callbacks write to (a shared filesystem
    on a cluster: the same files on every node), else the checkpoint this run started from."""
    directories = {Path(d) for d in (getattr(c, "dirpath", None) for c in trainer.checkpoint_callbacks) if d}
    directories |= {c.path.parent for c in trainer.callbacks if isinstance(c, SaveOnSignal)}
    found = [p for d in directories if d.is_dir() for p in d.glob("*.ckpt") if p.is_file()]
    if found:
        return max(found, key=lambda p: p.stat().st_mtime_ns)
    started = getattr(trainer, "ckpt_path", None)
    return Path(started) if started and Path(started).is_file() else None


def _checkpoint_step(path: Path | None) -> int | None:
    """The checkpoint's `global_step`, read without its weights; None if it cannot be read."""
    if path is None:
        return None
    try:
        checkpoint: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(checkpoint["global_step"])
    except Exception:  # the line still names the file; resuming from it says what is wrong with it
        return None
