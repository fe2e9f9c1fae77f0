"""The one error path of `train.py` and `evaluate.py`: a user error (`ConfigError`, or a data or checkpoint
error raised by its owner) ends in one `error:` line and exit status 1, never a traceback; so do Hydra's
composition errors (unknown key, group or option), job set-up failures (a run directory under a file),
the settings Lightning refuses only once its loop has started, and a full disk (or exceeded quota, or a
read-only filesystem) under any write: checkpoints, the data cache, logs, outputs, a sweep's storage
(`disk_full`, via `transformer.disk`), and a DDP run that lost one of its processes
(`transformer.training.peers`: what happened, the checkpoint to resume from). The traceback goes to the
run's log file.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import hydra
import lightning as L
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from data.sources import DataError
from transformer.checkpoint import CheckpointError
from transformer.disk import disk_full_line
from transformer.training.peers import PeerLostError

log = logging.getLogger(__name__)

__all__ = [
    "AGAIN",
    "USER_ERRORS",
    "ConfigError",
    "disk_full",
    "disk_full_exit",
    "first_line",
    "lightning_refusals",
    "one_line",
    "run",
    "traceback_to_log_file",
    "user_error",
]


class ConfigError(Exception):
    """A config value that cannot work: reported as one line naming the key, exit status 1."""


# What a user can fix (a config value, a data file, a checkpoint, a NaN/inf loss stop) or resume from (a DDP
# process lost: the line names the checkpoint): one line.
USER_ERRORS = (ConfigError, DataError, CheckpointError, FloatingPointError, PeerLostError)


def user_error(err: BaseException) -> SystemExit:
    """`err` as the one-line `error:` exit; its traceback goes to the run's log file only."""
    message = disk_full(err) or " ".join(str(err).split())
    traceback_to_log_file(message)
    return SystemExit(f"error: {message}")


AGAIN = "free some space, then run the same command again (train.py continues from the last whole checkpoint)"


def disk_full(err: BaseException, where: str | Path | None = None) -> str | None:
    """The one line for `err` if a full disk, an exceeded quota or a read-only filesystem caused it (the
    path, the cause, the free space, what needed writing), else None; `where`: the path to name when the
    failed write did not name its own."""
    return disk_full_line(err, where, then=AGAIN)


def disk_full_exit(err: BaseException, where: str | Path | None = None) -> SystemExit | None:
    """`err` as the one-line `error:` exit if a full disk caused it (traceback to the log file), else None."""
    message = disk_full(err, where)
    if message is None:
        return None
    traceback_to_log_file(message)
    return SystemExit(f"error: {message}")


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


@contextlib.contextmanager
def lightning_refusals() -> Iterator[None]:
    """Settings Lightning checks only once the loop starts (e.g. `trainer.val_check_interval` larger than
    an epoch) end the run with one line, like those checked up front."""
    try:
        yield
    except (MisconfigurationException, ValueError) as err:
        frames = traceback.extract_tb(err.__traceback__)
        raised_by_lightning = bool(frames) and frames[-1].filename.startswith(_LIGHTNING_DIR)
        if isinstance(err, MisconfigurationException) or raised_by_lightning:
            raise ConfigError(f"the trainer refused the config: {' '.join(str(err).split())}") from err
        raise


_LIGHTNING_DIR = str(Path(L.__file__).parent)


def traceback_to_log_file(message: str) -> None:
    """The full traceback goes to the run's log file only (the console gets the one-line message)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), sys.exc_info())
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def run(hydra_main: Callable[[], object], configs: Path, on_error: Callable[[Exception], str | None]) -> None:
    """Call the `@hydra.main` function `hydra_main`; `on_error` may turn any other exception into the
    one line to print (None: it is not a user error, the traceback stays)."""
    # Hydra then raises composition errors instead of printing them over several lines
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except (ConfigCompositionException, MissingConfigException, OverrideParseException) as err:
        raise SystemExit(f"error: {misspelled_trainer_key(one_line(str(err)))}") from None
    except Exception as err:  # raised outside a job (a sweeper's storage), or a job that is not ours
        message = on_error(err)  # a sweep's summary names its failed jobs' lines (a full disk's included)
        if message is None:
            message = disk_full(err)
            if message is not None:
                traceback_to_log_file(message)
        if message is not None:
            raise SystemExit(f"error: {message}") from None
        if _raised_by_hydra(err):  # e.g. `logger=null`, or hydra.run.dir under a file
            nulls = [
                a for a in sys.argv[1:] if a.endswith("=null") and (configs / a[:-5].lstrip("+")).is_dir()
            ]
            hint = f" ({nulls[0]}: a config group is removed with ~{nulls[0][:-5]})" if nulls else ""
            raise SystemExit(f"error: {one_line(str(err))}{hint}") from None
        raise


def _raised_by_hydra(err: BaseException) -> bool:
    """Whether `err` comes from Hydra composing the config or setting up the job, before any code of the
    job itself (`_hydra_main`) ran."""
    frames = traceback.extract_tb(err.__traceback__)
    hydra_dir = str(Path(hydra.__file__).parent)
    in_hydra = any(f.filename.startswith(hydra_dir) for f in frames)
    in_job = any(f.name == "_hydra_main" for f in frames)
    return in_hydra and not in_job and isinstance(err, (ValueError, OSError))


def misspelled_trainer_key(message: str) -> str:
    """Hydra's "Could not override 'trainer.max_epoch' ... use +trainer.max_epoch=1" for a key the Trainer
    does not have but nearly has: the key meant instead of the `+`, which only moves the error later."""
    found = re.match(r"Could not override 'trainer\.(\w+)'", message)
    if found is None:
        return message
    arguments = [name for name in inspect.signature(L.Trainer.__init__).parameters if name != "self"]
    close = difflib.get_close_matches(found[1], arguments, n=1)
    if found[1] in arguments or not close:
        return message
    return f"trainer.{found[1]} is not an argument of Trainer (did you mean trainer.{close[0]}?)"


def one_line(message: str) -> str:
    """Hydra's multi-line message as one line: option lists joined, the config search path left out."""
    parts: list[str] = []
    options: list[str] = []
    for line in message.splitlines():
        text = line.strip()
        if text.startswith("Config search path"):
            break
        if line.startswith("\t") and parts:  # one available option per line
            options.append(text)
            continue
        if options:
            parts[-1] += " " + ", ".join(options)
            options = []
        if text and not text.startswith(("full_key:", "object_type=")):
            parts.append(text)
    if options:
        parts[-1] += " " + ", ".join(options)
    return " ".join(parts)
