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
    objective_directions,
    objective_name,
    objective_names,
    pareto_front,
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
    pruned = [job.status == "pruned" for job, _ in points]
    for ax, key in zip(axes, keys):
        _panel(ax, [job.overrides.get(key) for job, _ in points], [m for _, m in points], pruned)
        ax.set_xlabel(key, fontsize=8)
        ax.set_ylabel(metric, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=110)
    return path


def _panel(ax: Axes, values: Sequence[Value], scores: Sequence[float], pruned: Sequence[bool]) -> None:
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        xs = [float(v) for v in values]
        if min(xs) > 0 and max(xs) / min(xs) >= 20:  # learning rates and the like
            ax.set_xscale("log")
    else:  # categories, in order of first appearance
        labels = list(dict.fromkeys(str(v) for v in values))
        xs = [float(labels.index(str(v))) for v in values]
        ax.set_xticks(range(len(labels)), labels=labels, rotation=30, fontsize=8)
    kept = [i for i, p in enumerate(pruned) if not p]
    ax.scatter([xs[i] for i in kept], [scores[i] for i in kept], s=14, alpha=0.6, label="job")
    if len(kept) < len(xs):  # stopped early by the pruner: their best value before the stop
        cut = [i for i, p in enumerate(pruned) if p]
        ax.scatter([xs[i] for i in cut], [scores[i] for i in cut], s=22, marker="x", c="gray", label="pruned")
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
        [
            _status(j),
            j.pruned_at_step,
            *(j.overrides.get(k) for k in keys),
            *(j.metrics.get(n) for n in names),
        ]
        for j in jobs
    ]
    pruned_column = ["pruned_at_step"] if any(j.pruned_at_step is not None for j in jobs) else []
    job_names = [j.path.relative_to(sweep_dir).as_posix() for j in jobs]
    written = {
        "jobs_csv": _write_csv(
            out_dir / "jobs.csv",
            ["job", "status", *pruned_column, *keys, *names],
            [[name, row[0], *row[2 - len(pruned_column) :]] for name, row in zip(job_names, job_rows)],
        ),
        "summary_csv": _write_summary_csv(out_dir / "summary.csv", groups, group_keys, names),
    }
    plot_path = out_dir / f"{_slug(metric or 'metric')}_vs_params.png"
    if metric is not None and plot_metric_vs_params(jobs, group_keys or keys, metric, plot_path):
        written["plot"] = plot_path
    objectives = objective_names(jobs)
    front = _pareto(jobs, objectives, out_dir, written) if len(objectives) > 1 and not metrics else None

    # report.md shows the metrics that differ between jobs (and the objective); the CSV files keep all
    shown = _varying_metrics(jobs, names, metric)
    report = MarkdownReport(f"Sweep {sweep_dir.name}")
    _overview(report, sweep_dir, jobs, keys, metric)
    _same_metrics(report, jobs, [n for n in names if n not in shown])
    if any(len(g.jobs) > 1 for g in groups):
        _groups_section(report, groups, group_keys, shown, seed_key)
    if front is not None:
        _pareto_section(report, sweep_dir, front, objectives, keys, written.get("pareto_plot"), out_dir)
    _jobs_section(report, job_names, jobs, keys, shown)
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
    n_pruned = sum(job.status == "pruned" for job in jobs)
    pruned = f" ({n_pruned} of them pruned)" if n_pruned else ""
    report.text(
        f"`{sweep_dir}`: {len(jobs)} jobs, {_n_finished(jobs)} finished{pruned}, "
        f"{len(jobs) - _n_finished(jobs)} failed or unfinished (no `metrics.json`)."
        + (f" Objective: `{metric}`." if metric else "")
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
    jobs: Sequence[Job],
    keys: Sequence[str],
    names: Sequence[str],
) -> None:
    """One row per job: its status (when not every job is done), swept values, the metrics `names`."""
    with_status = any(job.status != "done" for job in jobs)
    report.heading("Jobs")
    report.table(
        ["job", *(["status"] if with_status else []), *keys, *names],
        [
            [name, *([_fmt_status(job.status, job.pruned_at_step)] if with_status else [])]
            + [_fmt_param(job.overrides.get(k)) for k in keys]
            + [_fmt_metric(job.metrics.get(n)) for n in names]
            for name, job in zip(job_names, jobs)
        ],
    )


def _varying_metrics(jobs: Sequence[Job], names: Sequence[str], metric: str | None) -> list[str]:
    """The metrics of `names` whose value is not the same in every finished job, and `metric`; all of
    them when fewer than two jobs finished (nothing to compare)."""
    finished = [job for job in jobs if job.finished]
    if len(finished) < 2:
        return list(names)
    return [n for n in names if n == metric or len({repr(job.metrics.get(n)) for job in finished}) > 1]


def _same_metrics(report: MarkdownReport, jobs: Sequence[Job], names: Sequence[str]) -> None:
    """The metrics left out of the tables because every finished job reported the same value."""
    if names:
        first = next(job for job in jobs if job.finished)
        values = " ".join(f"`{n}={_fmt_metric(first.metrics.get(n))}`" for n in names)
        report.text(f"Same in every finished job (left out of the tables below; in jobs.csv): {values}")


def _status(job: Job) -> str:
    return job.status


def _fmt_status(status: str, pruned_at_step: int | None) -> str:
    return f"pruned at step {pruned_at_step}" if pruned_at_step is not None else status


def _n_finished(jobs: Sequence[Job]) -> int:
    return sum(job.finished for job in jobs)


def _pareto(jobs: Sequence[Job], objectives: list[str], out_dir: Path, written: dict[str, Path]) -> list[Job]:
    """The Pareto front of a multi-objective sweep; its plot (the first two objectives) into `written`."""
    directions = objective_directions(jobs, len(objectives))
    front = pareto_front(jobs, objectives, directions)
    x_name, y_name = objectives[:2]
    points = [
        j for j in jobs if j.status == "done" and None not in (j.metrics.get(x_name), j.metrics.get(y_name))
    ]
    if points:
        figure = Figure(figsize=(5.0, 4.0), layout="constrained")
        ax = figure.subplots()
        ax.scatter([j.metrics[x_name] for j in points], [j.metrics[y_name] for j in points], s=14, alpha=0.5,
                   label="trial")  # fmt: skip
        on_front = sorted((j.metrics[x_name], j.metrics[y_name]) for j in front)
        ax.plot(*zip(*on_front), "-o", c="C3", markersize=5, label="Pareto front")
        ax.set_xlabel(f"{x_name} ({directions[0]})", fontsize=8)
        ax.set_ylabel(f"{y_name} ({directions[1]})", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written["pareto_plot"] = out_dir / "pareto_front.png"
        figure.savefig(written["pareto_plot"], format="png", dpi=110)
    return front


def _pareto_section(
    report: MarkdownReport,
    sweep_dir: Path,
    front: Sequence[Job],
    objectives: Sequence[str],
    keys: Sequence[str],
    plot: Path | None,
    out_dir: Path,
) -> None:
    report.heading("Pareto front")
    report.text(
        f"The {len(front)} trials that no other finished trial beats on every objective "
        f"({', '.join(f'`{o}`' for o in objectives)})."
    )
    report.table(
        ["job", *keys, *objectives],
        [
            [j.path.relative_to(sweep_dir).as_posix(), *(_fmt_param(j.overrides.get(k)) for k in keys)]
            + [_fmt_metric(j.metrics.get(o)) for o in objectives]
            for j in front
        ],
    )
    if plot is not None:
        report.image(plot, "the objectives of every trial and the Pareto front", relative_to=out_dir)


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
