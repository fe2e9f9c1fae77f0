"""Evaluation outputs: metrics.json, hypotheses / predictions, and a Markdown report with its figures.

`write_translation_outputs` / `write_classification_outputs` turn a scoring result
(`transformer.evaluation.scoring`) into files in one output directory; report.md and its figures come
from `transformer.evaluation.report_sections`.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformer.disk import human_size, write_text, writing
from transformer.evaluation.lengths import LengthBucket, bleu_by_length, bleu_by_length_by_direction
from transformer.evaluation.markdown import MarkdownReport, markdown_table, one_line
from transformer.evaluation.report_sections import (
    ReportInputs,
    ReportOptions,
    write_classification_report,
    write_translation_report,
)
from transformer.evaluation.scoring import ClassificationResult, TranslationResult

__all__ = [
    "MarkdownReport",
    "ReportInputs",
    "ReportOptions",
    "markdown_table",
    "write_classification_outputs",
    "write_translation_outputs",
]


# Every file is written whole or not at all (`transformer.disk.write_text`): a full disk ends evaluate.py
# with one line naming the file, and leaves no half-written one.


def _write_json(path: Path, data: Mapping[str, Any]) -> Path:
    text = json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"
    return write_text(path, text, f"{path.name} of {_size(text)}")


def _write_tsv(path: Path, header: Sequence[str], rows: Sequence[Sequence[object]]) -> Path:
    buffer = io.StringIO()
    writer = csv.writer(buffer, delimiter="\t", lineterminator="\n")  # quotes cells with tabs/newlines
    writer.writerow(header)
    writer.writerows(rows)
    text = buffer.getvalue()
    return write_text(path, text, f"{path.name} of {_size(text)}")


def _bucket_rows(buckets: Sequence[LengthBucket]) -> list[dict[str, Any]]:
    return [{"words": b.label, "count": b.count, "bleu": b.bleu} for b in buckets]


def _size(text: str) -> str:
    return human_size(len(text.encode("utf-8")))


def _finite(metrics: Mapping[str, float]) -> dict[str, float | None]:
    return {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}


# --- translation --------------------------------------------------------------------------------------


def write_translation_outputs(
    out_dir: str | Path, result: TranslationResult, inputs: ReportInputs, *, decoding: Mapping[str, Any]
) -> dict[str, Path]:
    """metrics.json, hypotheses.txt, predictions.tsv and (inputs.options.enabled) report.md + PNGs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    edges = inputs.options.length_buckets
    buckets = bleu_by_length(
        result.sources, result.hypotheses, result.references, edges, result.source_labels
    )
    by_direction = bleu_by_length_by_direction(result, edges)  # {} for a single direction
    files = _write_translation_files(out_dir, result, buckets, by_direction, inputs.info, decoding)
    if inputs.options.enabled:
        with writing(out_dir / "report.md", "the report"):  # its figures name themselves
            files |= write_translation_report(out_dir, result, buckets, by_direction, inputs, decoding)
    return files


def _write_translation_files(
    out_dir: Path,
    result: TranslationResult,
    buckets: Sequence[LengthBucket],
    by_direction: Mapping[str, Sequence[LengthBucket]],
    info: Mapping[str, Any],
    decoding: Mapping[str, Any],
) -> dict[str, Path]:
    """metrics.json, hypotheses.txt (one line per example) and predictions.tsv."""
    metrics = {
        **_finite(result.metrics),
        **{f"{name}_signature": signature for name, signature in result.signatures.items()},
        "decoding": dict(decoding),
        "bleu_by_source_length": _bucket_rows(buckets),
        **(
            {"bleu_by_source_length_by_direction": {d: _bucket_rows(b) for d, b in by_direction.items()}}
            if by_direction
            else {}
        ),
        **info,
    }
    by_direction = bool(result.directions)  # predictions.tsv names each sentence's direction
    files = {
        "metrics": _write_json(out_dir / "metrics.json", metrics),
        "hypotheses": out_dir / "hypotheses.txt",
        "predictions": _write_tsv(
            out_dir / "predictions.tsv",
            [
                "id",
                *(["direction"] if by_direction else []),
                "source",
                "reference",
                "hypothesis",
                "sentence_bleu",
            ],
            [
                [i, *([result.directions[i]] if by_direction else []), s, r, h, f"{b:.2f}"]
                for i, (s, r, h, b) in enumerate(
                    zip(result.sources, result.references, result.hypotheses, result.sentence_bleu)
                )
            ],
        ),
    }
    hypotheses = "".join(one_line(h) + "\n" for h in result.hypotheses)
    write_text(files["hypotheses"], hypotheses, f"hypotheses.txt of {_size(hypotheses)}")
    for direction in sorted(set(result.directions)):  # a multilingual split: each direction's own file too
        name = f"hypotheses.{direction}.txt"
        lines = "".join(
            one_line(h) + "\n" for h, d in zip(result.hypotheses, result.directions) if d == direction
        )
        files[f"hypotheses_{direction}"] = write_text(out_dir / name, lines, f"{name} of {_size(lines)}")
    return files


# --- classification -----------------------------------------------------------------------------------


def write_classification_outputs(
    out_dir: str | Path, result: ClassificationResult, inputs: ReportInputs, *, texts: Sequence[str]
) -> dict[str, Path]:
    """metrics.json, predictions.tsv and (inputs.options.enabled) report.md + PNGs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _write_classification_files(out_dir, result, texts, inputs.info)
    if inputs.options.enabled:
        with writing(out_dir / "report.md", "the report"):  # its figures name themselves
            files |= write_classification_report(out_dir, result, inputs, texts)
    return files


def _write_classification_files(
    out_dir: Path, result: ClassificationResult, texts: Sequence[str], info: Mapping[str, Any]
) -> dict[str, Path]:
    """metrics.json (with per-class scores and the confusion matrix) and predictions.tsv."""
    names = result.class_names
    metrics = {
        **_finite(result.metrics),
        "per_class": result.per_class,
        "confusion_matrix": {"classes": names, "rows_gold_columns_predicted": result.confusion},
        **info,
    }
    rows = zip(texts, result.labels, result.predictions, result.confidence, result.probabilities)
    return {
        "metrics": _write_json(out_dir / "metrics.json", metrics),
        "predictions": _write_tsv(
            out_dir / "predictions.tsv",
            ["id", "text", "label", "prediction", "confidence", *[f"p({name})" for name in names]],
            [
                [i, text, names[gold], names[pred], f"{conf:.4f}", *[f"{p:.4f}" for p in probs]]
                for i, (text, gold, pred, conf, probs) in enumerate(rows)
            ],
        ),
    }
