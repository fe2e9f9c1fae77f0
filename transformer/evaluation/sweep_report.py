"""A multirun directory as tables and a plot: each job's overrides and final metrics, mean ± std over
seeds of otherwise identical jobs, and the objective against each swept parameter.

    aiayn-sweep-report MULTIRUN_DIR [--metric NAME] [--metrics NAME ...] [--out DIR]
    python -m transformer.evaluation.sweep_report MULTIRUN_DIR ...   # the same, without the console script

Works from files alone (no Hydra): a job is a directory holding `.hydra/overrides.yaml` (its
command-line overrides, as Hydra saved them) and, once it finished, the `metrics.json` train.py
writes. Writes jobs.csv, summary.csv, report.md and <metric>_vs_params.png into the directory.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from transformer.evaluation.reports import MarkdownReport

__all__ = ["Group", "Job", "group_jobs", "main", "parse_override", "read_jobs", "swept_keys", "write_report"]

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
    """`optimized_metric` from the first job's saved config (`.hydra/config.yaml`), if it has one."""
    for job in jobs:
        path = job.path / ".hydra" / "config.yaml"
        if path.is_file():
            config = yaml.safe_load(path.read_text()) or {}
            name = config.get("optimized_metric") if isinstance(config, dict) else None
            if isinstance(name, str) and "${" not in name:
                return name
    return None


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


# --- writing ------------------------------------------------------------------------------------------


def _fmt_param(value: Value) -> str:
    if value is None:
        return "null"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _fmt_metric(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _fmt_stat(stat: tuple[float, float | None, int] | None) -> str:
    if stat is None:
        return ""
    mean, std, _ = stat
    return f"{mean:.4g}" if std is None else f"{mean:.4g} ± {std:.2g}"


def _write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[object]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([["" if cell is None else cell for cell in row] for row in rows])
    return path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "metric"


def plot_metric_vs_params(jobs: Sequence[Job], keys: Sequence[str], metric: str, path: Path) -> Path | None:
    """One panel per swept parameter: every finished job as a dot and, where values repeat (a grid),
    the mean ± std of the jobs at each value; None when no job has the metric."""
    points = [(job, v) for job in jobs if (v := job.metrics.get(metric)) is not None and math.isfinite(v)]
    if not keys or not points:
        return None
    figure = Figure(figsize=(4.0 * len(keys), 3.4), layout="constrained")
    axes = figure.subplots(1, len(keys), squeeze=False)[0]
    for ax, key in zip(axes, keys):
        _panel(ax, [job.overrides.get(key) for job, _ in points], [m for _, m in points])
        ax.set_xlabel(key, fontsize=8)
        ax.set_ylabel(metric, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=110)
    return path


def _panel(ax: Axes, values: Sequence[Value], scores: Sequence[float]) -> None:
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        xs = [float(v) for v in values]
        if min(xs) > 0 and max(xs) / min(xs) >= 20:  # learning rates and the like
            ax.set_xscale("log")
    else:  # categories, in order of first appearance
        labels = list(dict.fromkeys(str(v) for v in values))
        xs = [float(labels.index(str(v))) for v in values]
        ax.set_xticks(range(len(labels)), labels=labels, rotation=30, fontsize=8)
    ax.scatter(xs, scores, s=14, alpha=0.6, label="job")
    at_x: dict[float, list[float]] = {}
    for x, score in zip(xs, scores):
        at_x.setdefault(x, []).append(score)
    if len(at_x) == len(xs):  # every value tried once (a search, not a grid): a line would mislead
        return
    at = sorted(at_x)
    ax.errorbar(
        at,
        [statistics.fmean(at_x[x]) for x in at],
        yerr=[statistics.stdev(at_x[x]) if len(at_x[x]) > 1 else 0.0 for x in at],
        fmt="-o",
        markersize=4,
        capsize=3,
        label="mean ± std",
    )


def write_report(
    sweep_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    metric: str | None = None,
    metrics: Sequence[str] | None = None,
    seed_key: str = "seed",
) -> dict[str, Path]:
    """Read the sweep, write jobs.csv, summary.csv, report.md and the plot; returns their paths by kind."""
    sweep_dir = Path(sweep_dir)
    jobs = read_jobs(sweep_dir)
    out_dir = Path(out_dir) if out_dir is not None else sweep_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    metric = metric or objective_name(jobs)
    names = list(metrics) if metrics else default_metrics(jobs, metric)
    metric = metric or (names[0] if names else None)
    if metric is not None and metric not in names:
        names.insert(0, metric)
    keys = swept_keys(jobs)
    group_keys = [k for k in keys if k != seed_key]
    groups = group_jobs(jobs, keys, names, seed_key)

    job_rows = [
        [_status(j), *(j.overrides.get(k) for k in keys), *(j.metrics.get(n) for n in names)] for j in jobs
    ]
    job_names = [j.path.relative_to(sweep_dir).as_posix() for j in jobs]
    written = {
        "jobs_csv": _write_csv(
            out_dir / "jobs.csv",
            ["job", "status", *keys, *names],
            [[name, *row] for name, row in zip(job_names, job_rows)],
        ),
        "summary_csv": _write_csv(
            out_dir / "summary.csv",
            [*group_keys, "jobs", "finished", *(f"{n} {part}" for n in names for part in ("mean", "std"))],
            [
                [*g.params.values(), len(g.jobs), _n_finished(g.jobs)]
                + [x for n in names for x in (g.stats[n][:2] if n in g.stats else (None, None))]
                for g in groups
            ],
        ),
    }
    plot_path = out_dir / f"{_slug(metric or 'metric')}_vs_params.png"
    if metric is not None and plot_metric_vs_params(jobs, group_keys or keys, metric, plot_path):
        written["plot"] = plot_path

    report = MarkdownReport(f"Sweep {sweep_dir.name}")
    report.text(
        f"`{sweep_dir}`: {len(jobs)} jobs, {_n_finished(jobs)} finished, {len(jobs) - _n_finished(jobs)} "
        "failed or unfinished (no `metrics.json`)." + (f" Objective: `{metric}`." if metric else "")
    )
    fixed = {k: v for k, v in jobs[0].overrides.items() if k not in keys}
    if fixed:
        report.text("Same in every job: " + " ".join(f"`{k}={_fmt_param(v)}`" for k, v in fixed.items()))
    if any(len(g.jobs) > 1 for g in groups):
        report.heading(f"Mean ± std over `{seed_key}`")
        report.table(
            [*group_keys, "jobs", *names],
            [
                [*map(_fmt_param, g.params.values()), f"{_n_finished(g.jobs)}/{len(g.jobs)}"]
                + [_fmt_stat(g.stats.get(n)) for n in names]
                for g in groups
            ],
        )
    report.heading("Jobs")
    report.table(
        ["job", "status", *keys, *names],
        [
            [name, status, *map(_fmt_param, row[: len(keys)]), *map(_fmt_metric, row[len(keys) :])]
            for name, (status, *row) in zip(job_names, job_rows)
        ],
    )
    if "plot" in written:
        report.heading(f"`{metric}` against each swept parameter")
        report.image(written["plot"], f"{metric} against the swept parameters", relative_to=out_dir)
    written["report"] = report.write(out_dir / "report.md")
    return written


def _status(job: Job) -> str:
    return "done" if job.finished else "failed"


def _n_finished(jobs: Sequence[Job]) -> int:
    return sum(job.finished for job in jobs)


# --- command line -------------------------------------------------------------------------------------


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m transformer.evaluation.sweep_report",
        description="Tabulate and plot a multirun or Optuna sweep directory: jobs.csv, summary.csv, "
        "report.md and a PNG of the metric against each swept parameter.",
    )
    parser.add_argument("sweep_dir", type=Path, help="the multirun directory (holds one directory per job)")
    parser.add_argument("--metric", help="metric to plot (default: the runs' optimized_metric)")
    parser.add_argument("--metrics", nargs="+", help="metric columns (default: every val/ and test/ metric)")
    parser.add_argument("--seed-key", default="seed", help="override averaged over (default: seed)")
    parser.add_argument("--out", type=Path, help="output directory (default: the sweep directory)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _arguments(argv)
    try:
        written = write_report(
            args.sweep_dir, args.out, metric=args.metric, metrics=args.metrics, seed_key=args.seed_key
        )
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in written.values():
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
