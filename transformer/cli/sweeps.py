"""Sweeps: the jobs of a sweep run in this process (the objective each returns to the sweeper, one wandb
run per job, the one-line summary when the sweep fails) and the sweep's Hydra callbacks (the one that
prepares an Optuna sweep's directory, configs/hparams_search/optuna.yaml, and the one that prints where a
finished sweep is and the command that tabulates it, configs/hydra/default.yaml: every sweep). The sweeper
itself (hydra_plugins/aiayn_optuna_sweeper) opens, checks and continues the study and offsets the
sampler's seed when it resumes; a diverged trial fails through the default `non_finite_loss` callback
(transformer/training/callbacks.py)."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write

from transformer.cli.errors import ConfigError, first_line

log = logging.getLogger("train")


def objective(cfg: DictConfig, metrics: Mapping[str, Any], needed: bool) -> float | list[float] | None:
    """The value of `optimized_metric`, what a sweeper optimizes (a list of values when it is a list of
    metrics: a multi-objective study). A run without it (one that ended before its first validation,
    e.g. `trainer.max_steps=20`) is fine on its own, and a failed trial in a sweep whose sweeper needs
    the value (Optuna; a grid needs none)."""
    names = cfg.get("optimized_metric") if cfg.get("train") else None
    if isinstance(names, ListConfig):
        values = [_one_objective(str(name), metrics, needed) for name in names]
        return None if any(v is None for v in values) else values
    return _one_objective(names, metrics, needed) if names else None


def _one_objective(name: str, metrics: Mapping[str, Any], needed: bool) -> float | None:
    if metrics.get(name) is not None:
        return metrics[name]
    validated = sorted(k for k in metrics if k.startswith("val/"))
    if validated:
        problem = f"optimized_metric={name} was not logged; the validation logged {', '.join(validated)}"
    else:
        problem = (
            f"no validation ran before training ended at step {metrics.get('global_step')}, "
            f"so optimized_metric={name} has no value"
        )
    if needed:
        raise ConfigError(problem)
    (log.warning if validated else log.info)("%s", problem[0].upper() + problem[1:])
    return None


def sweeper_uses_objective(hydra_cfg: DictConfig) -> bool:
    """Whether the sweeper reads the jobs' return values: every sweeper but Hydra's grid (BasicSweeper)."""
    return not str(hydra_cfg.sweeper.get("_target_", "")).endswith(".BasicSweeper")


@dataclass
class SweepJob:
    """One job of a sweep run in this process, for the summary when the sweep fails."""

    num: int
    overrides: list[str]
    output_dir: Path
    error: str | None = None

    def fail(self, error: str) -> None:
        self.error = error

    def finish(self) -> None:
        """End this job's wandb run (the jobs share the process: the next one would reuse it)."""
        wandb = sys.modules.get("wandb")  # imported only if a wandb logger was built
        if wandb is not None and wandb.run is not None:
            wandb.finish(exit_code=1 if self.error is not None else 0)


class SweepJobs(list[SweepJob]):
    """The jobs of the sweep that runs in this command (Hydra's basic launcher runs them one after the
    other in this process), in order: one object per command (train.py makes it), so that a process
    that runs several commands (tests, notebooks) never mixes their jobs."""

    def start(self, cfg: DictConfig, hydra_cfg: DictConfig) -> SweepJob:
        """Record the sweep job that runs now; in a sweep every job is its own wandb run, grouped under
        the sweep directory's name (the study name for `hparams_search`) unless `logger.wandb.group` is
        set. A trial of the Optuna sweeper gets the callback that reports to its trial (and prunes it)."""
        wandb = (cfg.get("logger") or {}).get("wandb")
        if wandb is not None and not wandb.get("group"):
            with open_dict(wandb):
                wandb.group = Path(hydra_cfg.sweep.dir).name
        add_trial_callback(cfg, hydra_cfg.sweeper)
        job = SweepJob(hydra_cfg.job.num, list(hydra_cfg.overrides.task), Path(hydra_cfg.runtime.output_dir))
        self.append(job)
        return job

    def failure_summary(self, err: BaseException) -> str | None:
        """One line on a sweep that stopped with `err`: how many jobs failed, the first one's error, where
        the logs are. None outside a sweep."""
        if not self:  # jobs in other processes (submitit): the sweeper's own line, if it has one
            return first_line(err) if getattr(err, "user_facing", False) else None
        failed = [job for job in self if job.error is not None]
        if not failed:
            return f"the sweep failed after {len(self)} jobs: {type(err).__name__}: {first_line(err)}"
        first = failed[0]
        logs = first.output_dir.parent / "*" / "train.log"
        if len(failed) == len(self):
            what = f"every job of the sweep failed ({len(failed)} of {len(self)})"
        else:
            what = f"{len(failed)} of the sweep's {len(self)} jobs failed"
        which = "the first, job" if len(failed) > 1 else "job"
        overrides = " ".join(first.overrides) or "no overrides"
        return f"{what}; {which} {first.num} ({overrides}): {first.error}; logs: {logs}"


TRIAL_CALLBACK = "transformer.training.optuna_trial.OptunaTrialReporter"


def add_trial_callback(cfg: DictConfig, sweeper: DictConfig) -> None:
    """`callbacks.optuna_trial` for a job of the Optuna sweeper (hydra/sweeper=aiayn_optuna), which names
    the job's trial in `hydra.sweeper.trial_number`; nothing for other sweepers or an in-memory study."""
    number, storage = sweeper.get("trial_number"), sweeper.get("storage")
    if number is None or storage is None or not cfg.get("train"):
        return
    metric = cfg.get("optimized_metric")
    pruner = sweeper.get("pruner")
    node = {
        "_target_": TRIAL_CALLBACK,
        "storage": storage,
        "study_name": sweeper.study_name,
        "trial_number": number,
        "monitor": None if isinstance(metric, ListConfig) else metric,  # several objectives: not reported
        "pruner": OmegaConf.to_container(pruner, resolve=True) if pruner is not None else None,
    }
    with open_dict(cfg):
        if cfg.get("callbacks") is None:
            cfg.callbacks = {}
        with open_dict(cfg.callbacks):
            cfg.callbacks.optuna_trial = node


# --- the Hydra callbacks of a sweep (configs name them by `_target_`) -------------------------------


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
