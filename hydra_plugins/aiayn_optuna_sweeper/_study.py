"""The sweep: check `hydra.sweeper`, open (or continue) the study, then ask a batch of trials, launch them
through Hydra's launcher, tell the study how each ended (COMPLETE, PRUNED or FAIL), until `n_trials`.

Every check runs before the storage is opened, and a study that already exists is compared (directions,
parameters) before it is touched, so bad input changes nothing. A job learns its trial from the override
`hydra.sweeper.trial_number=N`; a job whose training was pruned marks its trial with the user attribute
`pruned_at_step` (transformer/training/optuna_trial.py), so its trial is told PRUNED, not COMPLETE."""

from __future__ import annotations

import logging
import math
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import optuna
import yaml
from hydra.core.utils import JobReturn
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from hydra_plugins.aiayn_optuna_sweeper._space import SearchSpace, SweepConfigError, parse_space

log = logging.getLogger(__name__)

__all__ = ["PRUNED_AT_STEP", "Settings", "SweepFailed", "open_study", "read_settings", "run_sweep"]

PRUNED_AT_STEP = "pruned_at_step"  # the trial user attribute a pruned job sets (its last step)


class SweepFailed(RuntimeError):
    """The sweep stopped because its trials failed; the message is one line for the user."""

    user_facing = True


SweepConfigError.user_facing = True  # type: ignore[attr-defined]


@dataclass
class Settings:
    """`hydra.sweeper`, checked."""

    directions: list[str]
    n_trials: int
    n_jobs: int
    max_failure_rate: float
    storage: str | None
    study_name: str | None
    sampler: dict[str, Any] | None  # the config: built again with the seed offset when a study continues
    pruner: Any
    space: SearchSpace


def read_settings(sweeper: dict[str, Any], config: DictConfig, arguments: list[str]) -> Settings:
    """Every `hydra.sweeper` value checked, sampler and pruner built: a SweepConfigError names the key."""
    raw = sweeper.get("direction", "minimize")
    directions = [raw] if isinstance(raw, str) else list(raw or [])
    if not directions or any(d not in ("minimize", "maximize") for d in directions):
        raise SweepConfigError(
            f"hydra.sweeper.direction: expected minimize, maximize or a list of them, got {raw}"
        )
    metric = config.get("optimized_metric")
    metrics = list(metric) if isinstance(metric, (list, ListConfig)) else [metric]
    if metric is not None and len(metrics) != len(directions):
        raise SweepConfigError(
            f"hydra.sweeper.direction: {len(directions)} direction(s) {directions} for "
            f"{len(metrics)} optimized_metric(s) {metrics}; give one direction per metric"
        )
    storage = sweeper.get("storage")
    if storage is not None and not isinstance(storage, str):
        raise SweepConfigError(f"hydra.sweeper.storage: expected a database URL or null, got {storage!r}")
    if storage is not None:
        _check_storage(storage)
    numbers = {}
    for key, kind, low in (("n_trials", int, 1), ("n_jobs", int, 1), ("max_failure_rate", float, 0.0)):
        value = sweeper.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
            raise SweepConfigError(f"hydra.sweeper.{key}: expected a number >= {low}, got {value!r}")
        numbers[key] = kind(value)
    space = parse_space(sweeper.get("params"), arguments)
    pruner = _build("pruner", sweeper.get("pruner"), optuna.pruners.BasePruner)
    if pruner is not None and len(directions) > 1:
        raise SweepConfigError(
            f"hydra.sweeper.pruner: Optuna cannot prune a study with {len(directions)} objectives "
            f"({', '.join(map(str, metrics))}); remove the pruner (hydra.sweeper.pruner=null)"
        )
    if pruner is not None and storage is None:
        raise SweepConfigError(
            "hydra.sweeper.pruner: pruning needs hydra.sweeper.storage (a database the trials report to)"
        )
    sampler_cfg = sweeper.get("sampler")
    if isinstance(sampler_cfg, dict) and str(sampler_cfg.get("_target_", "")).endswith("GridSampler"):
        sampler_cfg = {**sampler_cfg, "search_space": sampler_cfg.get("search_space") or _grid(space)}
    _build("sampler", sampler_cfg, optuna.samplers.BaseSampler)  # checked now, built when the study opens
    return Settings(
        directions, numbers["n_trials"], numbers["n_jobs"], numbers["max_failure_rate"], storage,
        sweeper.get("study_name"), sampler_cfg, pruner, space,
    )  # fmt: skip


def _check_storage(storage: str) -> None:
    """A storage URL that SQLAlchemy cannot read, or whose database driver is missing, is refused here,
    before anything is opened: Optuna would fail later, deep in SQLAlchemy, with a traceback."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    expected = "expected a database URL such as sqlite:///PATH/optuna.db (or null: in memory)"
    try:
        url = make_url(storage)
        dialect = url.get_dialect()
    except ArgumentError as err:  # unparseable, or an unknown dialect (NoSuchModuleError)
        raise SweepConfigError(f"hydra.sweeper.storage={storage}: {expected} ({err})") from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        raise SweepConfigError(
            f"hydra.sweeper.storage={url.render_as_string(hide_password=True)}: "
            f"the database driver of {url.drivername} is not installed ({err})"
        ) from None


def _build(key: str, node: Any, base: type) -> Any:
    if node is None:
        return None
    if not isinstance(node, dict) or "_target_" not in node:
        raise SweepConfigError(f"hydra.sweeper.{key}: expected a config with _target_, got {node!r}")
    try:
        built = instantiate(node, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__ or err
        message = " ".join(str(cause).split())
        raise SweepConfigError(f"hydra.sweeper.{key}._target_={node['_target_']}: {message}") from None
    if not isinstance(built, base):
        raise SweepConfigError(
            f"hydra.sweeper.{key}._target_={node['_target_']}: not an optuna.{key}s class ({base.__name__})"
        )
    return built


def _grid(space: SearchSpace) -> dict[str, list[Any]]:
    """The grid sampler's search space from the params: choice() values, range() steps."""
    grid: dict[str, list[Any]] = {}
    for name, dist in space.distributions.items():
        if isinstance(dist, CategoricalDistribution):
            grid[name] = list(dist.choices)
        elif isinstance(dist, IntDistribution) and not dist.log:
            grid[name] = list(range(dist.low, dist.high + 1, dist.step))
        elif isinstance(dist, FloatDistribution) and dist.step is not None:
            steps = round((dist.high - dist.low) / dist.step)
            grid[name] = [dist.low + i * dist.step for i in range(steps + 1)]
        else:
            raise SweepConfigError(
                f"hydra.sweeper.params.{name}: the grid sampler needs choice() or range(), not an interval"
            )
    return grid


def open_study(settings: Settings) -> optuna.Study:
    """The study of `storage`/`study_name`: an existing one after checking that it searches the same
    parameters in the same directions (it is continued), else a new one. A continued study's sampler
    seed is offset by its number of trials: the samplers draw from a fresh generator on every run, and
    a fixed seed would replay the first run's trials instead of drawing new ones."""
    existing = _existing_study(settings)
    sampler_cfg = settings.sampler
    if existing is not None:
        _check_compatible(existing, settings)
        n_trials = len(existing.trials)
        log.info(
            "Resuming Optuna study %r (%d trials so far) from %s",
            existing.study_name,
            n_trials,
            settings.storage,
        )
        seed = (sampler_cfg or {}).get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool) and n_trials:
            sampler_cfg = {**sampler_cfg, "seed": seed + n_trials}
            log.info("Sampler seed %d -> %d (so the resumed search draws new trials)", seed, seed + n_trials)
    return optuna.create_study(
        storage=settings.storage,
        study_name=settings.study_name,
        sampler=_build("sampler", sampler_cfg, optuna.samplers.BaseSampler),
        pruner=settings.pruner,
        directions=settings.directions,
        load_if_exists=existing is not None,
    )


def _existing_study(settings: Settings) -> optuna.Study | None:
    if settings.storage is None or settings.study_name is None:
        return None
    if settings.storage.startswith("sqlite:///"):
        path = settings.storage[len("sqlite:///") :].split("?", 1)[0]
        if path not in ("", ":memory:") and not Path(path).is_file():
            return None  # loading would create the file
    try:
        return optuna.load_study(study_name=settings.study_name, storage=settings.storage)
    except KeyError:
        return None


def _check_compatible(study: optuna.Study, settings: Settings) -> None:
    name = settings.study_name
    directions = [d.name.lower() for d in study.directions]
    if directions != settings.directions:
        raise SweepConfigError(
            f"hydra.sweeper.study_name={name}: the study in {settings.storage} has direction {directions}, "
            f"this sweep {settings.directions}; pick another study_name"
        )
    wanted = settings.space.distributions
    for trial in study.get_trials(deepcopy=False):
        if trial.distributions != wanted:
            raise SweepConfigError(
                f"hydra.sweeper.study_name={name}: the study in {settings.storage} searched other parameters "
                f"({_describe(trial.distributions)}) than this sweep ({_describe(wanted)}); "
                "pick another study_name or give the same search space"
            )


def _describe(distributions: dict[str, Any]) -> str:
    return ", ".join(f"{k}={d}" for k, d in sorted(distributions.items())) or "none"


def run_sweep(sweeper: Any, arguments: list[str]) -> list[list[JobReturn]]:
    """`hydra.sweeper`'s trials, batch by batch; the study is left consistent whatever stops the sweep."""
    config = sweeper.config
    settings = read_settings(sweeper.settings, config, arguments)
    if settings.storage is not None:
        _sqlite_directory(settings.storage)
    study = open_study(settings)
    extra = [] if settings.study_name else [f"hydra.sweeper.study_name={study.study_name}"]
    sweep_dir = Path(str(config.hydra.sweep.dir))
    returns: list[list[JobReturn]] = []
    counts = {state: 0 for state in TrialState}
    first_failure = ""
    job_idx = 0
    interrupted = _CtrlC()
    while job_idx < settings.n_trials:
        size = min(settings.n_jobs, settings.n_trials - job_idx)
        trials: list[optuna.Trial] = []
        try:  # Ctrl-C or a launcher error, from the first ask on: the study keeps no RUNNING trial
            with interrupted:
                trials += [study.ask(settings.space.distributions) for _ in range(size)]
                batch = [
                    [*settings.space.overrides(t.params), *extra, f"hydra.sweeper.trial_number={t.number}"]
                    for t in trials
                ]
                sweeper.validate_batch_is_legal(batch)
                results = sweeper.launcher.launch(batch, initial_job_idx=job_idx)
            if interrupted.seen:  # its KeyboardInterrupt was swallowed (raised inside a library's cleanup
                # callback) and the jobs ran on to their end: the study records what they did (a pruned
                # job's run directory says pruned, so must the study), then the sweep stops all the same
                for trial, result in zip(trials, results):
                    _tell(study, trial, result, settings)
                raise KeyboardInterrupt
        except BaseException:
            _fail_running(study, trials)
            raise
        job_idx += size
        returns.append(list(results))
        for trial, result in zip(trials, results):
            state, error = _tell(study, trial, result, settings)
            counts[state] += 1
            first_failure = first_failure or (error and f"trial {trial.number}: {error}")
        finished = sum(counts.values())
        if counts[TrialState.FAIL] / finished > settings.max_failure_rate:
            raise SweepFailed(
                f"{counts[TrialState.FAIL]} of {finished} trials failed, more than "
                f"hydra.sweeper.max_failure_rate={settings.max_failure_rate}; the first, {first_failure}"
            )
    _write_results(study, sweep_dir, counts)
    if counts[TrialState.FAIL] == sum(counts.values()):
        raise SweepFailed(
            f"every trial of the sweep failed ({counts[TrialState.FAIL]}); the first, {first_failure}"
        )
    return returns


class _CtrlC:
    """While entered (in the main thread): SIGINT is remembered in `seen`, then raises KeyboardInterrupt as
    Python's own handler does. A KeyboardInterrupt raised inside a finalizer or a library's callback is
    printed and dropped by Python; `seen` still says that the user asked the sweep to stop."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def _sqlite_directory(storage: str) -> None:
    if storage.startswith("sqlite:///"):
        path = storage[len("sqlite:///") :].split("?", 1)[0]
        if path not in ("", ":memory:"):
            Path(path).parent.mkdir(parents=True, exist_ok=True)


def _fail_running(study: optuna.Study, trials: list[optuna.Trial]) -> None:
    for trial in trials:
        _tell_study(study, trial, state=TrialState.FAIL, skip_if_finished=True)


def _tell_study(study: optuna.Study, trial: optuna.Trial, values: Any = None, **kwargs: Any) -> None:
    """`study.tell`. The grid sampler calls `study.stop()` once every point is tried, which Optuna only
    allows inside `study.optimize` (RuntimeError); the trial is stored by then, and further trials
    repeat grid points (as the grid sampler does in `study.optimize` beyond its grid)."""
    try:
        study.tell(trial, values, **kwargs)
    except RuntimeError as err:
        if "Study.stop" not in str(err):
            raise
        log.info("The grid sampler has tried every point of its grid")


def _tell(
    study: optuna.Study, trial: optuna.Trial, result: JobReturn, settings: Settings
) -> tuple[TrialState, str]:
    """Tell the study how the trial's job ended; the state and, for a failure, its one-line error."""
    try:
        value = result.return_value
    except Exception as err:  # the job raised: its log file has the traceback
        error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        log.warning("Trial %d failed: %s", trial.number, error)
        _tell_study(study, trial, state=TrialState.FAIL)
        return TrialState.FAIL, error
    frozen = next(
        (
            t
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if t.number == trial.number
        ),
        None,
    )
    if frozen is not None and PRUNED_AT_STEP in frozen.user_attrs:
        log.info("Trial %d pruned at step %s", trial.number, frozen.user_attrs[PRUNED_AT_STEP])
        _tell_study(study, trial, state=TrialState.PRUNED)
        return TrialState.PRUNED, ""
    values = _values(value, len(settings.directions))
    if values is None:
        error = f"the job returned {value!r}, not {len(settings.directions)} finite number(s)"
        log.warning("Trial %d failed: %s", trial.number, error)
        _tell_study(study, trial, state=TrialState.FAIL)
        return TrialState.FAIL, error
    _tell_study(study, trial, values)
    log.info("Trial %d finished with %s", trial.number, values[0] if len(values) == 1 else values)
    return TrialState.COMPLETE, ""


def _values(value: Any, n: int) -> list[float] | None:
    items = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    try:
        numbers = [float(v) for v in items]
    except (TypeError, ValueError):
        return None
    return numbers if len(numbers) == n and all(math.isfinite(v) for v in numbers) else None


def _write_results(study: optuna.Study, sweep_dir: Path, counts: dict[TrialState, int]) -> None:
    """`optimization_results.yaml` in the sweep directory: the best trial (the Pareto front for several
    objectives) of the whole study, and this run's trial counts."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    results: dict[str, Any] = {"name": "optuna", "study_name": study.study_name}
    results["this_run"] = {s.name.lower(): n for s, n in counts.items() if n}
    if complete and len(study.directions) == 1:
        best = study.best_trial
        results.update(best_params=dict(best.params), best_value=best.value, best_trial=best.number)
    elif complete:
        results["best_trials"] = [
            {"number": t.number, "params": dict(t.params), "values": list(t.values)}
            for t in study.best_trials
        ]
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "optimization_results.yaml").write_text(yaml.safe_dump(results, sort_keys=False))
    if complete:
        log.info("Best so far: %s", results.get("best_value", results.get("best_trials")))
