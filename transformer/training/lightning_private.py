"""Every use of a Lightning API that is not public, in one place, each with what it is for.

Checked against Lightning `CHECKED_WITH`; `tests/unit/test_lightning_private.py` builds a real trainer and
fails, naming the attribute, when an installed Lightning lacks one of them or has another minor version
(then re-check each use below and update `CHECKED_WITH`). Nothing else in the project touches Lightning's
private names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.fabric.utilities.types import _PATH as PATH  # str | os.PathLike: a checkpoint's path

__all__ = [
    "CHECKED_WITH",
    "PATH",
    "accumulating",
    "forget_launched_ranks",
    "process_group_timeout",
    "replace_sigterm_broadcast",
    "should_update_logs",
    "val_batch_progress",
]

CHECKED_WITH = "2.6"  # the minor version of Lightning whose private names were read


def should_update_logs(trainer: L.Trainer) -> bool:
    """Whether this batch's logged values are written (`trainer._logger_connector.should_update_logs`),
    so that a value shown on the progress bar is read back only when the logger reads anyway."""
    return trainer._logger_connector.should_update_logs


def accumulating(trainer: L.Trainer) -> bool:
    """Mid gradient-accumulation window: the batch just run is not followed by an optimizer step
    (`fit_loop.epoch_loop._should_accumulate()`)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def replace_sigterm_broadcast(trainer: L.Trainer, when: Callable[[], bool]) -> None:
    """Under DDP, the training loop broadcasts rank 0's SIGTERM flag before every batch and reads it back
    (`_TrainingEpochLoop._broadcast_sigterm_tensor`): run it only at the batches where `when()` holds (it
    must be the same on every rank, so that the collective still pairs up). Does nothing where the loop
    has no such method, or already has a replacement."""
    loop = trainer.fit_loop.epoch_loop
    broadcast = getattr(type(loop), "_broadcast_sigterm_tensor", None)
    if broadcast is None or "_broadcast_sigterm_tensor" in vars(loop):
        return

    def at_chosen_batches() -> None:
        if when():
            broadcast(loop)

    loop._broadcast_sigterm_tensor = at_chosen_batches


def forget_launched_ranks(trainer: L.Trainer) -> None:
    """On the process that started the other DDP ranks (Lightning's subprocess launcher), empty the
    launcher's list of their processes (`strategy.launcher.procs`): the thread that watches them
    SIGKILLs this process when another rank exits with a non-zero status."""
    children = getattr(trainer.strategy.launcher, "procs", None)
    if children:
        children.clear()


def process_group_timeout(strategy: Any) -> timedelta | None:
    """How long the DDP strategy's collectives wait for the other processes (the `timeout` it was built
    with, kept as `DDPStrategy._timeout`), to name it when a process did not answer; None if not DDP."""
    timeout = getattr(strategy, "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else None


def val_batch_progress(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The validation loop's batch counters in a checkpoint being saved (the loops' state layout:
    `checkpoint["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]`, with "total" and
    "current" counts of started / processed / completed batches)."""
    return checkpoint["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]
