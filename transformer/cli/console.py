"""What a training run prints: at its start the config as its overrides and the path of its saved copy
(`print_config=true`: whole), without Lightning's tips and the deprecation warning of its own code, nor,
on a resume, its warning that our resumable sampler is not; log files without colour codes."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Lightning's rank_zero_info messages that advertise a product or restate the config
_NOISE = (
    "💡 Tip:",  # litlogger / litmodels
    "Trainer already configured with model summary callbacks",  # the summary callback of configs/callbacks
)
# An escape sequence (colours, cursor moves) as rich and colorlog write them
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NOISE)


def quiet_lightning() -> None:
    """Drop Lightning's tips and its note on our model summary, and the FutureWarning that torch (2.13
    here) raises on Lightning's own use of `LeafSpec` (lightning/pytorch/utilities/_pytree.py, 2.6:
    nothing for a user to change). Every other message and warning stays. Idempotent."""
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropNoise) for f in rank_zero.filters):
        rank_zero.addFilter(_DropNoise())
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


@contextmanager
def sampler_resumes(checkpoint: Mapping[str, Any] | None, datamodule: object) -> Iterator[None]:
    """Resuming from a checkpoint written mid-epoch, Lightning warns that "your dataloader is not
    resumable" because the DataLoader has no `state_dict`. Ours need none: the datamodule saves its
    sampler's position in the checkpoint and restores it (data/datamodules/base.py), and the resumed
    epoch skips the batches already trained on. Where the checkpoint holds that position, the warning
    is untrue and not shown (inside this block); without it (another datamodule) it stays."""
    state = (checkpoint or {}).get(type(datamodule).__qualname__)
    with warnings.catch_warnings():
        if isinstance(state, Mapping) and "train_sampler" in state:
            warnings.filterwarnings(
                "ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended"
            )
        yield


def config_message(config_path: Path, overrides: Sequence[str]) -> str:
    """One line in place of the whole resolved config: where it is saved and what the command changed."""
    changed = " ".join(overrides) if overrides else "none"
    return f"Config: {config_path} (overrides: {changed}; print_config=true logs it whole)"


class PlainFormatter(logging.Formatter):
    """The log format with escape sequences removed: a log file reads the same in any viewer (the file
    handler of configs/hydra/default.yaml; a message coloured for the terminal keeps its text)."""

    def format(self, record: logging.LogRecord) -> str:
        return _ANSI.sub("", super().format(record))
