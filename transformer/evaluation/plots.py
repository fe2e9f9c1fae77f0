"""Figures of an evaluation report (matplotlib) and the training logs the learning curves come from.

Figures are drawn on `matplotlib.figure.Figure` objects (no pyplot, no global backend state), so
plotting works headless and never touches anyone else's figures. Learning curves are read back from
a training run's CSV logger (`metrics.csv`) or TensorBoard event files.
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from transformer.disk import writing

log = logging.getLogger(__name__)

__all__ = [
    "read_learning_curves",
    "save_attention_heads",
    "save_bar_chart",
    "save_confusion_matrix",
    "save_grouped_bar_chart",
    "save_learning_curves",
]

Curves = dict[str, list[tuple[int, float]]]  # metric name -> (step, value) points in step order
# Panels of the learning-curve figure, in this order: the metric name after the stage prefix.
_CURVE_PANELS = ("loss", "bleu", "chrf", "acc", "f1", "ppl", "token_acc", "lr")
_MAX_TICK_LABELS = 48  # beyond this many tokens per axis the labels are unreadable: leave them off


# --- figures ------------------------------------------------------------------------------------------


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing(path, f"the figure {path.name}"):  # a half-written PNG is removed
        figure.savefig(path, format="png", dpi=110)
    return path


def _panels(
    rows: int,
    cols: int,
    panel: tuple[float, float],
    gap: tuple[float, float],
    margins: tuple[float, float, float, float],
) -> tuple[Figure, np.ndarray]:
    """A figure of rows x cols axes of `panel` (width, height) inches, `gap` (across, down) inches apart, with
    `margins` (left, right, bottom, top) in inches around them: a fixed layout (matplotlib's constrained
    layout measured every tick label to place the panels, half of a figure's time); (figure, axes array)."""
    (panel_w, panel_h), (gap_w, gap_h), (left, right, bottom, top) = panel, gap, margins
    width = left + (cols * panel_w + (cols - 1) * gap_w) + right
    height = bottom + (rows * panel_h + (rows - 1) * gap_h) + top
    figure = Figure(figsize=(width, height))
    axes = figure.subplots(
        rows,
        cols,
        squeeze=False,
        gridspec_kw={
            "left": left / width,
            "right": (width - right) / width,
            "bottom": bottom / height,
            "top": (height - top) / height,
            "wspace": gap_w / panel_w,
            "hspace": gap_h / panel_h,
        },
    )
    return figure, axes


def _label_axis(ax: Axes, tokens: Sequence[str], axis: str) -> None:
    if len(tokens) > _MAX_TICK_LABELS:
        return
    positions = range(len(tokens))
    if axis == "x":
        ax.set_xticks(positions, labels=tokens, rotation=90, fontsize=7)
    else:
        ax.set_yticks(positions, labels=tokens, fontsize=7)


def _label_margin(tokens: Sequence[str]) -> float:
    """Inches that the tick labels of `tokens` take at fontsize 7 (about 0.05 inch a character)."""
    if len(tokens) > _MAX_TICK_LABELS:
        return 0.2
    return 0.25 + 0.05 * max((len(t) for t in tokens), default=0)


def save_attention_heads(
    weights: np.ndarray | Sequence[Sequence[Sequence[float]]],
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    path: str | Path,
    title: str,
) -> Path:
    """One heatmap per head of a (H, T_q, T_k) attention tensor: rows are queries, columns keys."""
    weights = np.asarray(weights, dtype=np.float32)
    if weights.ndim != 3 or weights.shape[1:] != (len(query_tokens), len(key_tokens)):
        raise ValueError(
            f"weights must be (heads, {len(query_tokens)} queries, {len(key_tokens)} keys), "
            f"got shape {weights.shape}"
        )
    H = weights.shape[0]
    cols = min(H, 4)
    rows = math.ceil(H / cols)
    side = max(2.5, 0.18 * max(len(query_tokens), len(key_tokens)) + 1.0)
    # the margins hold the longest label at this font size, the title and the colour bar
    bottom, gap = _label_margin(key_tokens) + 0.15, 0.35
    margins = (_label_margin(query_tokens) + 0.15, 0.9, bottom, 0.6)
    figure, axes = _panels(rows, cols, (side, side), (gap, gap), margins)
    width, height = figure.get_size_inches()
    panels_height = rows * side + (rows - 1) * gap
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.set_axis_off()
            continue
        image = ax.imshow(weights[h], vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        ax.set_title(f"head {h}", fontsize=9)
        # the heads share their tokens: keys under each column's lowest head, queries left of each row
        # (labelling every head drew the same text eight times, most of a report's time)
        if h + cols >= H:
            _label_axis(ax, key_tokens, "x")
        else:
            ax.set_xticks([])
        if h % cols == 0:
            _label_axis(ax, query_tokens, "y")
        else:
            ax.set_yticks([])
    figure.suptitle(title, fontsize=10, y=1 - 0.15 / height, va="top")
    if image is not None:
        # a bar 0.15 inch wide beside the panels' middle 60%
        bar = (
            (width - 0.75) / width,
            (bottom + 0.2 * panels_height) / height,
            0.15 / width,
            0.6 * panels_height / height,
        )
        figure.colorbar(image, cax=figure.add_axes(bar))
    return _save(figure, path)


def save_confusion_matrix(
    matrix: np.ndarray | Sequence[Sequence[int]], class_names: Sequence[str], path: str | Path
) -> Path:
    """Counts with gold classes as rows and predictions as columns, each cell annotated."""
    matrix = np.asarray(matrix)
    C = len(class_names)
    if matrix.shape != (C, C):
        raise ValueError(f"confusion matrix must be ({C}, {C}) for {C} classes, got shape {matrix.shape}")
    side = max(3.0, 0.6 * C + 1.5)
    figure = Figure(figsize=(side + 1.0, side), layout="constrained")
    ax = figure.subplots()
    image = ax.imshow(matrix, cmap="Blues")
    threshold = matrix.max() / 2 if matrix.size else 0
    for gold in range(C):
        for predicted in range(C):
            value = matrix[gold, predicted]
            color = "white" if value > threshold else "black"
            ax.text(predicted, gold, str(int(value)), ha="center", va="center", color=color, fontsize=8)
    ax.set_xticks(range(C), labels=list(class_names), rotation=45, ha="right")
    ax.set_yticks(range(C), labels=list(class_names))
    ax.set_xlabel("predicted")
    ax.set_ylabel("gold")
    figure.colorbar(image, ax=ax, shrink=0.8)
    return _save(figure, path)


def save_bar_chart(
    labels: Sequence[str],
    values: Sequence[float],
    path: str | Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    counts: Sequence[int] | None = None,
) -> Path:
    """A bar per label (e.g. BLEU per source-length bucket), annotated with `counts` when given."""
    if len(labels) != len(values) or (counts is not None and len(counts) != len(values)):
        raise ValueError(
            f"got {len(labels)} labels, {len(values)} values and {counts and len(counts)} counts"
        )
    figure, ax = _bar_axes(len(labels), 0.8)
    bars = ax.bar(range(len(values)), values, color="tab:blue")
    if counts is not None:
        ax.bar_label(bars, labels=[f"n={c}" for c in counts], fontsize=7)
    return _save_bars(figure, ax, labels, path, title, xlabel, ylabel)


def save_grouped_bar_chart(
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
) -> Path:
    """One group of bars per label, a bar per series in each (e.g. BLEU per source-length bucket for
    each direction) with a legend; a NaN value leaves its bar out."""
    if not series or any(len(values) != len(labels) for values in series.values()):
        raise ValueError(f"every series needs a value per label ({len(labels)}), got {dict(series)}")
    width = 0.8 / len(series)
    figure, ax = _bar_axes(len(labels), 0.3 + 0.25 * len(series))
    for k, (name, values) in enumerate(series.items()):
        offset = (k - (len(series) - 1) / 2) * width
        ax.bar([i + offset for i in range(len(labels))], values, width, label=name)
    ax.legend(fontsize=7, loc="best")
    return _save_bars(figure, ax, labels, path, title, xlabel, ylabel)


def _bar_axes(n_labels: int, inches_per_label: float) -> tuple[Figure, Axes]:
    """A bar chart's figure: 3.1 inches of plot or wider (`inches_per_label` each), 2.3 high; the margins
    hold the title, the axis labels and ticks."""
    figure, axes = _panels(
        1, 1, (max(3.1, inches_per_label * n_labels + 1.1), 2.3), (0.0, 0.0), (0.75, 0.15, 0.55, 0.35)
    )
    return figure, axes[0, 0]


def _save_bars(
    figure: Figure, ax: Axes, labels: Sequence[str], path: str | Path, title: str, xlabel: str, ylabel: str
) -> Path:
    """A bar chart's ticks (one per label), title and axis names, then the file."""
    ax.set_xticks(range(len(labels)), labels=list(labels))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)
    return _save(figure, path)


# --- learning curves ----------------------------------------------------------------------------------


def read_learning_curves(run_dir: str | Path) -> Curves:
    """Scalar curves logged by a training run: its CSV logger files, else its TensorBoard events.

    Returns {} when the run directory has neither (e.g. only a wandb logger was used).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return {}
    curves: dict[str, dict[int, float]] = {}
    for path in sorted(run_dir.rglob("metrics.csv")):
        _read_csv(path, curves)
    if not curves:
        for path in sorted(run_dir.rglob("events.out.tfevents.*")):
            _read_tensorboard(path, curves)
    return {name: sorted(points.items()) for name, points in sorted(curves.items()) if points}


def _read_csv(path: Path, curves: dict[str, dict[int, float]]) -> None:
    with path.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            try:
                step = int(float(row.get("step") or "nan"))
            except ValueError:
                continue  # a row without a step (cannot be placed on the x axis)
            for name, value in row.items():
                if name in ("step", "epoch") or not value:
                    continue
                try:
                    curves.setdefault(name, {})[step] = float(value)
                except ValueError:
                    continue  # not a number (a text column)


def _read_tensorboard(path: Path, curves: dict[str, dict[int, float]]) -> None:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:  # tensorboard is a dev extra
        log.info("tensorboard is not installed: cannot read learning curves from %s", path)
        return
    events = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0 = keep every point
    events.Reload()
    for tag in events.Tags().get("scalars", []):
        for event in events.Scalars(tag):
            curves.setdefault(tag, {})[int(event.step)] = float(event.value)


def _panel(name: str) -> str:
    if name.startswith("lr-") or name.endswith("/lr"):
        return "lr"
    metric = name.rsplit("/", 1)[-1]
    base, _, direction = metric.rpartition("_")  # a multilingual run's "bleu_en-de": the BLEU panel
    return base if "-" in direction and base in _CURVE_PANELS else metric


def save_learning_curves(curves: Mapping[str, Sequence[tuple[int, float]]], path: str | Path) -> Path | None:
    """One panel per metric (loss, BLEU, accuracy, ... learning rate), train and val curves together.

    Single points (test metrics) and bookkeeping series (throughput, padding) are left out; returns
    None when nothing is left to draw.
    """
    panels: dict[str, list[str]] = {}
    for name, points in curves.items():
        panel = _panel(name)
        if panel in _CURVE_PANELS and len(points) > 1 and not name.startswith("test/"):
            panels.setdefault(panel, []).append(name)
    if not panels:
        return None
    order = [panel for panel in _CURVE_PANELS if panel in panels]
    cols = min(len(order), 3)
    rows = math.ceil(len(order) / cols)
    # 4.2 x 3.0 inches a panel with its share of the margins; the gaps hold the next panel's tick labels
    # across, "step" and the next row's title down
    figure, axes = _panels(rows, cols, (3.3, 2.2), (0.9, 0.8), (0.75, 0.15, 0.5, 0.3))
    for ax, panel in zip(axes.flat, order):
        for name in sorted(panels[panel]):
            steps, values = zip(*curves[name])
            ax.plot(steps, values, label=name, marker="." if len(steps) < 30 else None)
        ax.set_title(panel)
        ax.set_xlabel("step")
        if panel == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        elif panel == "ppl" and all(v > 0 for name in panels[panel] for _, v in curves[name]):
            ax.set_yscale("log")  # perplexity falls by orders of magnitude early on
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(order) :]:
        ax.set_axis_off()
    return _save(figure, path)
