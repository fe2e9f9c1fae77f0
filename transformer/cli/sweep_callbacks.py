"""The Hydra callbacks of a sweep: the one that prepares an Optuna sweep's directory
(configs/hparams_search/optuna.yaml turns it on), and the one that prints where a finished sweep is and
the command that tabulates it (configs/hydra/default.yaml: every sweep). The sweeper itself
(hydra_plugins/aiayn_optuna_sweeper) opens, checks and continues the study and offsets the sampler's
seed when it resumes; a diverged trial fails through the default `non_finite_loss` callback
(transformer/training/callbacks.py).

Part of the command-line edge (`transformer.cli`), which alone imports Hydra: Hydra finds the callbacks by
their `_target_`; nothing else in the package imports this file.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

__all__ = ["ResumeOptunaStudy", "SweepEndLines", "sqlite_path"]

_SQLITE_PREFIX = "sqlite:///"


def sqlite_path(storage: str) -> Path | None:
    """The database file of an SQLAlchemy SQLite URL (`sqlite:///relative` or `sqlite:////absolute`)."""
    if not storage.startswith(_SQLITE_PREFIX):
        return None
    path = storage[len(_SQLITE_PREFIX) :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


class ResumeOptunaStudy(HydraCallback):
    """Before an Optuna sweep starts: fix the start time in job directory names.

    Job numbers restart at 0 on every run of a resumed search, so job directories carry the run's start
    time (`${now:...}` in `hydra.sweep.subdir`); it is resolved once here, because Hydra hands this
    process's resolver cache to every job, and the ranks of a multi-node job resolve their directory
    separately. (The name stays: configs of earlier versions name this class.)
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _resolve_now_once(config)


def _resolve_now_once(config: DictConfig) -> None:
    """Resolve each `${now:PATTERN}` of `hydra.sweep.subdir` against the root config: `now` is a
    cached resolver, so the time stays in the root's cache, which Hydra copies into every job."""
    sweep = config.hydra.sweep
    subdir = OmegaConf.to_container(sweep, resolve=False).get("subdir")
    for pattern in re.findall(r"\$\{now:([^}]*)\}", str(subdir or "")):
        with read_write(sweep), open_dict(sweep):
            sweep["_start_time"] = f"${{now:{pattern}}}"
            str(sweep["_start_time"])
            del sweep["_start_time"]


class SweepEndLines(HydraCallback):
    """After the last job of a sweep: its directory and the `aiayn-sweep-report` command for it, the
    last lines on stdout (as a single run ends with its run directory); on stderr when the jobs
    translate text to stdout (`evaluate.py -m ... translate.input=...`), which carries translations only."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        directory = config.hydra.sweep.dir
        translating = OmegaConf.select(config, "translate.input", default=None) is not None
        stream = sys.stderr if translating else sys.stdout
        print(f"sweep directory: {directory}", file=stream)
        print(f"tables and plots of its jobs: aiayn-sweep-report {directory}", file=stream)
        stream.flush()
