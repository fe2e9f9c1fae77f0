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
import math
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from transformer.evaluation.markdown import MarkdownReport
from transformer.evaluation.sweep_jobs import (
    Group,
    Job,
    Value,
    default_metrics,
    group_jobs,
    objective_name,
    parse_override,
    read_jobs,
    swept_keys,
)

__all__ = ["Group", "Job", "group_jobs", "main", "parse_override", "read_jobs", "swept_keys", "write_report"]


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
    metric, names = _metric_columns(jobs, metric, metrics)
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
        "summary_csv": _write_summary_csv(out_dir / "summary.csv", groups, group_keys, names),
    }
    plot_path = out_dir / f"{_slug(metric or 'metric')}_vs_params.png"
    if metric is not None and plot_metric_vs_params(jobs, group_keys or keys, metric, plot_path):
        written["plot"] = plot_path

    report = MarkdownReport(f"Sweep {sweep_dir.name}")
    _overview(report, sweep_dir, jobs, keys, metric)
    if any(len(g.jobs) > 1 for g in groups):
        _groups_section(report, groups, group_keys, names, seed_key)
    _jobs_section(report, job_names, job_rows, keys, names)
    if "plot" in written:
        report.heading(f"`{metric}` against each swept parameter")
        report.image(written["plot"], f"{metric} against the swept parameters", relative_to=out_dir)
    written["report"] = report.write(out_dir / "report.md")
    return written


def _metric_columns(
    jobs: Sequence[Job], metric: str | None, metrics: Sequence[str] | None
) -> tuple[str | None, list[str]]:
    """The metric to plot (given, else the objective, else the first column) and the metric columns
    (given, else the defaults), the plotted one among them."""
    metric = metric or objective_name(jobs)
    names = list(metrics) if metrics else default_metrics(jobs, metric)
    metric = metric or (names[0] if names else None)
    if metric is not None and metric not in names:
        names.insert(0, metric)
    return metric, names


def _write_summary_csv(
    path: Path, groups: Sequence[Group], group_keys: Sequence[str], names: Sequence[str]
) -> Path:
    return _write_csv(
        path,
        [*group_keys, "jobs", "finished", *(f"{n} {part}" for n in names for part in ("mean", "std"))],
        [
            [*g.params.values(), len(g.jobs), _n_finished(g.jobs)]
            + [x for n in names for x in (g.stats[n][:2] if n in g.stats else (None, None))]
            for g in groups
        ],
    )


def _overview(
    report: MarkdownReport, sweep_dir: Path, jobs: Sequence[Job], keys: Sequence[str], metric: str | None
) -> None:
    """How many jobs finished, the objective, and the overrides every job shares."""
    report.text(
        f"`{sweep_dir}`: {len(jobs)} jobs, {_n_finished(jobs)} finished, {len(jobs) - _n_finished(jobs)} "
        "failed or unfinished (no `metrics.json`)." + (f" Objective: `{metric}`." if metric else "")
    )
    fixed = {k: v for k, v in jobs[0].overrides.items() if k not in keys}
    if fixed:
        report.text("Same in every job: " + " ".join(f"`{k}={_fmt_param(v)}`" for k, v in fixed.items()))


def _groups_section(
    report: MarkdownReport,
    groups: Sequence[Group],
    group_keys: Sequence[str],
    names: Sequence[str],
    seed_key: str,
) -> None:
    report.heading(f"Mean ± std over `{seed_key}`")
    report.table(
        [*group_keys, "jobs", *names],
        [
            [*map(_fmt_param, g.params.values()), f"{_n_finished(g.jobs)}/{len(g.jobs)}"]
            + [_fmt_stat(g.stats.get(n)) for n in names]
            for g in groups
        ],
    )


def _jobs_section(
    report: MarkdownReport,
    job_names: Sequence[str],
    job_rows: Sequence[Sequence[object]],
    keys: Sequence[str],
    names: Sequence[str],
) -> None:
    """One row per job: status, swept values, metrics (`job_rows` as in jobs.csv, without the name)."""
    report.heading("Jobs")
    report.table(
        ["job", "status", *keys, *names],
        [
            [name, status, *map(_fmt_param, row[: len(keys)]), *map(_fmt_metric, row[len(keys) :])]
            for name, (status, *row) in zip(job_names, job_rows)
        ],
    )


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
