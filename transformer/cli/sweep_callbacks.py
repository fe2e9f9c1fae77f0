"""The Hydra callback that lets an Optuna search resume (configs/hparams_search/optuna.yaml turns it on).

`ResumeOptunaStudy` prepares the Optuna storage before the sweeper opens the study, so that the SQLite file
can live inside the sweep directory and a second run of the same command continues the study. (A diverged
trial fails through the default `non_finite_loss` callback, transformer/training/callbacks.py.)

Part of the command-line edge (`transformer.cli`), which alone imports Hydra: Hydra finds the callback by its
`_target_`; nothing else in the package imports this file.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)

__all__ = ["ResumeOptunaStudy", "sqlite_path"]

_SQLITE_PREFIX = "sqlite:///"


def sqlite_path(storage: str) -> Path | None:
    """The database file of an SQLAlchemy SQLite URL (`sqlite:///relative` or `sqlite:////absolute`)."""
    if not storage.startswith(_SQLITE_PREFIX):
        return None
    path = storage[len(_SQLITE_PREFIX) :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


class ResumeOptunaStudy(HydraCallback):
    """Before an Optuna sweep starts: create the SQLite file's directory; when the study already has
    trials, offset the sampler's seed by their number; fix the start time in job directory names.

    The sweeper opens the study before any job runs (and before Hydra creates the sweep directory),
    and SQLite cannot create a missing directory. Optuna's samplers draw from a fresh RNG on every
    run: without the offset a resumed search with a fixed seed would replay the random start-up
    trials of the first run (same parameters, wasted trials) instead of continuing it. Job numbers
    restart at 0 on every run, so job directories carry the run's start time (`${now:...}` in
    `hydra.sweep.subdir`); it is resolved once here, because Hydra hands this process's resolver
    cache to every job, and the ranks of a multi-node job resolve their directory separately.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _resolve_now_once(config)
        sweeper = config.hydra.sweeper
        storage, study_name = sweeper.get("storage"), sweeper.get("study_name")
        if not isinstance(storage, str):  # not the Optuna sweeper, or an in-memory study
            return
        database = sqlite_path(storage)
        if database is not None:
            database.parent.mkdir(parents=True, exist_ok=True)
            if not database.is_file():  # a new study: nothing to resume
                return
        n_trials = _count_trials(storage, study_name)
        if not n_trials:
            return
        seed = sweeper.get("sampler", {}).get("seed")
        log.info("Resuming Optuna study %r (%d trials so far) from %s", study_name, n_trials, storage)
        if isinstance(seed, int):
            with read_write(sweeper.sampler):
                sweeper.sampler.seed = seed + n_trials
            log.info("Sampler seed %d -> %d (so the resumed search draws new trials)", seed, seed + n_trials)


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


def _count_trials(storage: str, study_name: str | None) -> int:
    import optuna  # the `sweep` extra; only needed when a sweep runs

    if study_name is None:  # optuna names an unnamed study at random: a new one every run
        return 0
    try:
        return len(optuna.load_study(study_name=study_name, storage=storage).trials)
    except KeyError:  # the database exists but holds no study of that name yet
        return 0
