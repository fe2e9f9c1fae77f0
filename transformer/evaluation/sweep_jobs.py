"""A sweep directory read back from its files (no Hydra): each job's overrides (`.hydra/overrides.yaml`)
and final metrics (the `metrics.json` train.py writes), and the groups of jobs that differ only in the
seed, with mean and std of each metric."""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

__all__ = [
    "Group",
    "Job",
    "Value",
    "default_metrics",
    "group_jobs",
    "objective_directions",
    "objective_name",
    "objective_names",
    "pareto_front",
    "parse_override",
    "read_jobs",
    "swept_keys",
]

Value = str | int | float | bool | None


@dataclass
class Job:
    """One job directory of a sweep: its overrides (key -> value) and final metrics ({} if it failed)."""

    path: Path
    overrides: dict[str, Value]
    metrics: dict[str, float | None] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return bool(self.metrics)

    @property
    def pruned_at_step(self) -> int | None:
        """The optimizer step where the Optuna pruner stopped this job (its `metrics.json` says so)."""
        if not self.metrics.get("optuna/pruned"):
            return None
        step = self.metrics.get("optuna/pruned_at_step")
        return int(step) if step is not None else None

    @property
    def status(self) -> str:
        """done, pruned (stopped early by the Optuna pruner, with its metrics) or failed (no metrics)."""
        if not self.finished:
            return "failed"
        return "done" if self.pruned_at_step is None else "pruned"


@dataclass
class Group:
    """Jobs equal in every swept parameter but the seed; `stats[metric] = (mean, std, n)` over those
    that finished (std is None for one job)."""

    params: dict[str, Value]
    jobs: list[Job]
    stats: dict[str, tuple[float, float | None, int]]


# --- reading a sweep ----------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[str, Value]:
    """`key=value` as Hydra saved it -> (key without `+`/`++`/`~`, value as int/float/bool/None/str)."""
    key, sep, raw = str(text).partition("=")
    key = key.lstrip("+~")
    if not sep or not key:
        raise ValueError(f"not a key=value override: {text!r}")
    return key, _parse_value(raw.strip())


def _parse_value(raw: str) -> Value:
    lowered = raw.lower()
    if lowered in ("null", "none", "~"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for number in (int, float):
        try:
            return number(raw)
        except ValueError:
            pass
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    return raw


def _natural_key(path: Path) -> list[object]:
    """`2` before `10`: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def read_jobs(sweep_dir: str | Path) -> list[Job]:
    """Every job directory under `sweep_dir` (any depth), in natural order of their paths."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ValueError(f"{sweep_dir} is not a directory (give a multirun / sweep directory)")
    jobs = []
    for overrides_file in sweep_dir.rglob(".hydra/overrides.yaml"):
        job_dir = overrides_file.parent.parent
        try:
            overrides = yaml.safe_load(overrides_file.read_text()) or []
        except yaml.YAMLError as err:
            raise ValueError(f"{overrides_file}: not YAML ({err})") from err
        if not isinstance(overrides, list):
            raise ValueError(f"{overrides_file}: expected a list of key=value overrides, got {overrides!r}")
        jobs.append(Job(job_dir, dict(parse_override(o) for o in overrides), _read_metrics(job_dir)))
    if not jobs:
        raise ValueError(f"no job directories (with .hydra/overrides.yaml) under {sweep_dir}")
    return sorted(jobs, key=lambda job: _natural_key(job.path.relative_to(sweep_dir)))


def _read_metrics(job_dir: Path) -> dict[str, float | None]:
    path = job_dir / "metrics.json"
    if not path.is_file():  # failed, or still running
        return {}
    try:
        metrics = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from err
    # numbers only (paths and names are not metrics); null stays None: train.py writes NaN / inf as null
    return {
        name: (float(value) if value is not None else None)
        for name, value in metrics.items()
        if value is None or (isinstance(value, int | float) and not isinstance(value, bool))
    }


def objective_name(jobs: Sequence[Job]) -> str | None:
    """`optimized_metric` from the first job's saved config (`.hydra/config.yaml`), if it has one (the
    first of several objectives)."""
    names = objective_names(jobs)
    return names[0] if names else None


def objective_names(jobs: Sequence[Job]) -> list[str]:
    """`optimized_metric` from the first job's saved config: one name, or several (a multi-objective
    study); [] if no job has it."""
    for job in jobs:
        config = _read_yaml(job.path / ".hydra" / "config.yaml")
        name = config.get("optimized_metric")
        names = name if isinstance(name, list) else [name]
        if names and all(isinstance(n, str) and "${" not in n for n in names):
            return list(names)
    return []


def objective_directions(jobs: Sequence[Job], n: int) -> list[str]:
    """`hydra.sweeper.direction` of the sweep (`.hydra/hydra.yaml`), one per objective; `maximize` for
    every objective when no job saved one."""
    for job in jobs:
        sweeper = (_read_yaml(job.path / ".hydra" / "hydra.yaml").get("hydra") or {}).get("sweeper") or {}
        direction = sweeper.get("direction")
        directions = [direction] if isinstance(direction, str) else direction
        if isinstance(directions, list) and len(directions) == n:
            return [str(d) for d in directions]
    return ["maximize"] * n


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def pareto_front(jobs: Sequence[Job], names: Sequence[str], directions: Sequence[str]) -> list[Job]:
    """The jobs no other job dominates on `names` (each maximized or minimized as `directions` says),
    among those that finished unpruned with a finite value of every objective; in the order given."""
    sign = [1.0 if d == "maximize" else -1.0 for d in directions]
    scored = []
    for job in jobs:
        values = [job.metrics.get(n) for n in names]
        if job.status == "done" and all(v is not None and math.isfinite(v) for v in values):
            scored.append((job, [s * v for s, v in zip(sign, values)]))

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x >= y for x, y in zip(a, b)) and any(x > y for x, y in zip(a, b))

    return [job for job, a in scored if not any(dominates(b, a) for _, b in scored)]


def default_metrics(jobs: Sequence[Job], objective: str | None) -> list[str]:
    """The objective first, then every validation and test metric any job reported, sorted."""
    names = sorted({n for job in jobs for n in job.metrics if n.startswith(("val/", "test/"))})
    if objective is not None:
        names = [objective, *(n for n in names if n != objective)]
    return names


# --- grouping -----------------------------------------------------------------------------------------


def swept_keys(jobs: Sequence[Job]) -> list[str]:
    """Override keys whose value is not the same in every job (a key some jobs lack counts as swept)."""
    keys: list[str] = []
    for job in jobs:
        keys += [k for k in job.overrides if k not in keys]
    missing = object()
    return [k for k in keys if len({repr(job.overrides.get(k, missing)) for job in jobs}) > 1]


def group_jobs(
    jobs: Sequence[Job], keys: Sequence[str], metrics: Sequence[str], seed_key: str
) -> list[Group]:
    """Jobs that differ only in `seed_key`, with mean, sample std and count of each metric over them."""
    params_keys = [k for k in keys if k != seed_key]
    groups: dict[tuple[str, ...], Group] = {}
    for job in jobs:
        params = {k: job.overrides.get(k) for k in params_keys}
        ident = tuple(repr(v) for v in params.values())
        groups.setdefault(ident, Group(params, [], {})).jobs.append(job)
    for group in groups.values():
        for name in metrics:
            values = [
                v for job in group.jobs if (v := job.metrics.get(name)) is not None and math.isfinite(v)
            ]
            if values:
                std = statistics.stdev(values) if len(values) > 1 else None
                group.stats[name] = (statistics.fmean(values), std, len(values))
    return list(groups.values())
