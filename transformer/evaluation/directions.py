"""A multilingual model's scores by direction (docs/multilingual.md) as people read them: the table
evaluate.py and train.py print, and the report's section and plot. The scores themselves come from
`scoring.direction_scores` (`{name}_{direction}`, e.g. "bleu_en-de", with `n_sentences_{direction}`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from transformer.evaluation.markdown import MarkdownReport
from transformer.evaluation.plots import save_bar_chart

COUNT = "n_sentences"  # `n_sentences_{direction}`: how many sentences a direction has (names them too)
SHOWN = ("bleu", "chrf", "exact_match")  # the columns of the printed table and the report's


def directions_in(metrics: Mapping[str, float], stage: str) -> list[str]:
    """The directions `metrics` holds scores of (their `{stage}/n_sentences_{direction}` keys), sorted."""
    prefix = f"{stage}/{COUNT}_"
    return sorted(key[len(prefix) :] for key in metrics if key.startswith(prefix))


def direction_rows(metrics: Mapping[str, float], stage: str) -> list[list[object]]:
    """One row per direction: direction, sentences, then `SHOWN`'s scores."""
    return [
        [direction, int(metrics[f"{stage}/{COUNT}_{direction}"])]
        + [metrics.get(f"{stage}/{name}_{direction}", float("nan")) for name in SHOWN]
        for direction in directions_in(metrics, stage)
    ]


def direction_table(metrics: Mapping[str, float], stage: str) -> str:
    """The per-direction rows as a plain text table (evaluate.py prints it); "" for a single direction."""
    rows = direction_rows(metrics, stage)
    if not rows:
        return ""
    header = ["direction", "sentences", *SHOWN]
    cells = [header] + [[str(r[0]), str(r[1]), *(f"{v:.2f}" for v in r[2:])] for r in rows]
    widths = [max(len(row[k]) for row in cells) for k in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def direction_section(
    report: MarkdownReport, metrics: Mapping[str, float], stage: str, out_dir: Path
) -> Path | None:
    """The report's per-direction table and BLEU bar chart; the chart's path (None: a single direction)."""
    rows = direction_rows(metrics, stage)
    if not rows:
        return None
    report.heading("Per direction")
    report.table(["direction", "sentences", *SHOWN], rows)
    path = save_bar_chart(
        [str(r[0]) for r in rows],
        [float(r[2]) for r in rows],
        out_dir / "bleu_by_direction.png",
        title="BLEU by direction",
        xlabel="direction",
        ylabel="BLEU",
        counts=[int(r[1]) for r in rows],
    )
    report.image(path, "BLEU by direction", out_dir)
    return path
