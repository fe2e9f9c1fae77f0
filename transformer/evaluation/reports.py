"""Evaluation outputs: metrics.json, hypotheses / predictions, and a Markdown report with its figures.

`write_translation_outputs` / `write_classification_outputs` turn a scoring result
(`transformer.evaluation`) into files in one output directory; figures come from
`transformer.evaluation.plots`.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from transformer.evaluation.plots import (
    Curves,
    save_attention_heads,
    save_bar_chart,
    save_confusion_matrix,
    save_learning_curves,
)
from transformer.evaluation.scoring import (
    ClassificationResult,
    TranslationResult,
    attention_maps,
    bleu_by_length,
)

__all__ = [
    "MarkdownReport",
    "ReportOptions",
    "markdown_table",
    "write_classification_outputs",
    "write_translation_outputs",
]


@dataclass
class ReportOptions:
    """What goes into report.md (the `report` node of configs/eval.yaml)."""

    enabled: bool = True
    samples: int = 5  # best / worst sentences, confident mistakes
    attention_examples: int = 2  # sentences whose attention maps are drawn
    attention_layers: Sequence[int] = (-1,)  # layer indices (negative from the top)
    max_attention_tokens: int = 30  # prefer sentences at most this long for readable heatmaps
    length_buckets: Sequence[int] = (5, 10, 15, 20, 30)  # source words: 1-5, 6-10, ..., 31+

    def __post_init__(self) -> None:
        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be true or false, got {self.enabled!r}")
        for name in ("samples", "attention_examples", "max_attention_tokens"):
            value, low = getattr(self, name), 1 if name == "max_attention_tokens" else 0
            if not integer(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        layers = self.attention_layers
        if (
            isinstance(layers, (str, bytes))
            or not isinstance(layers, Sequence)
            or not all(map(integer, layers))
        ):
            raise ValueError(f"attention_layers must be a list of layer indices, got {layers!r}")
        buckets = self.length_buckets
        if (
            isinstance(buckets, (str, bytes))
            or not isinstance(buckets, Sequence)
            or not all(integer(b) and b >= 1 for b in buckets)
            or list(buckets) != sorted(set(buckets))
        ):
            raise ValueError(f"length_buckets must be increasing word counts >= 1, got {buckets!r}")


# --- Markdown -----------------------------------------------------------------------------------------


def _cell(value: object) -> str:
    if isinstance(value, float):
        text = f"{value:.2f}" if math.isfinite(value) else str(value)
    else:
        text = str(value)
    # a pipe would end the cell and a newline the row; backticks stay literal text
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; floats get two decimals, pipes and newlines are escaped."""
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells (the header's), got {[len(r) for r in rows]}")
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class MarkdownReport:
    """Blocks of Markdown written to one file; images are referenced relative to that file."""

    def __init__(self, title: str) -> None:
        self.blocks: list[str] = [f"# {title}"]

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(f"{'#' * level} {text}")

    def text(self, text: str) -> None:
        self.blocks.append(text)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        self.blocks.append(markdown_table(header, rows))

    def code(self, text: str) -> None:
        fence = "````" if "```" in text else "```"
        self.blocks.append(f"{fence}\n{text}\n{fence}")

    def image(self, path: str | Path, alt: str, relative_to: str | Path) -> None:
        self.blocks.append(f"![{_cell(alt)}]({Path(path).relative_to(relative_to).as_posix()})")

    def to_markdown(self) -> str:
        return "\n\n".join(self.blocks) + "\n"

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_markdown(), encoding="utf-8")
        return path


# --- files --------------------------------------------------------------------------------------------


def _write_json(path: Path, data: Mapping[str, Any]) -> Path:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")
    return path


def _write_tsv(path: Path, header: Sequence[str], rows: Sequence[Sequence[object]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter="\t", lineterminator="\n")  # quotes cells with tabs/newlines
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


def _finite(metrics: Mapping[str, float]) -> dict[str, float | None]:
    return {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}


def _info_section(report: MarkdownReport, info: Mapping[str, Any]) -> None:
    report.heading("Checkpoint and data")
    report.table(["", ""], [[key, _one_line(str(value))] for key, value in info.items() if value is not None])


def _metrics_section(report: MarkdownReport, metrics: Mapping[str, float]) -> None:
    report.heading("Metrics")
    report.table(["metric", "value"], [[name, f"{value:.4f}"] for name, value in metrics.items()])


def _curves_section(report: MarkdownReport, out_dir: Path, curves: Curves, source: str | None) -> None:
    report.heading("Learning curves")
    path = save_learning_curves(curves, out_dir / "learning_curves.png") if curves else None
    if path is None:
        report.text(f"No learning curves: no CSV or TensorBoard logs with curves in {source or 'the run'}.")
        return
    report.text(f"Logged by the training run in `{source}`.")
    report.image(path, "learning curves", out_dir)


def _layers(n_layers: int, wanted: Sequence[int]) -> list[int]:
    chosen = []
    for index in wanted:
        if not -n_layers <= index < n_layers:
            raise ValueError(
                f"report.attention_layers: layer {index} does not exist (the model has {n_layers})"
            )
        chosen.append(index % n_layers)
    return sorted(set(chosen))


# (id, src ids, src tokens, tgt_in ids, output tokens); the last two are None for an encoder-only model
_AttentionExample = tuple[int, list[int], list[str], list[int] | None, list[str] | None]


def _attention_section(
    report: MarkdownReport,
    out_dir: Path,
    model: nn.Module,
    examples: Sequence[_AttentionExample],
    options: ReportOptions,
) -> list[Path]:
    """Heatmaps per head for each (id, src ids, src tokens, tgt_in ids, output tokens) example."""
    titles = {
        "encoder_self": "encoder self-attention (rows: source tokens)",
        "decoder_self": "decoder self-attention (rows: output tokens, columns: decoder inputs)",
        "cross": "cross-attention (rows: output tokens, columns: source tokens)",
    }
    report.heading("Attention maps")
    paths: list[Path] = []
    for index, src_ids, src_tokens, tgt_in, out_tokens in examples:
        maps = attention_maps(model, src_ids, tgt_in)
        report.heading(f"Example {index}", level=3)
        for kind, per_layer in maps.items():
            keys = src_tokens if kind != "decoder_self" else ["<s>", *(out_tokens or [])[:-1]]
            queries = src_tokens if kind == "encoder_self" else list(out_tokens or [])
            for layer in _layers(len(per_layer), options.attention_layers):
                path = out_dir / "attention" / f"example{index}_{kind}_layer{layer}.png"
                title = f"example {index}: {titles[kind]}, layer {layer}"
                paths.append(save_attention_heads(per_layer[layer].numpy(), queries, keys, path, title))
                report.image(path, title, out_dir)
    return paths


def _pick_examples(lengths: Sequence[int], n: int, max_tokens: int) -> list[int]:
    """The first `n` examples (split order) no longer than `max_tokens`; the shortest ones otherwise."""
    short = [i for i, length in enumerate(lengths) if length <= max_tokens][:n]
    return (
        short
        if len(short) == min(n, len(lengths))
        else sorted(range(len(lengths)), key=lengths.__getitem__)[:n]
    )


def _finish_report(
    report: MarkdownReport,
    files: dict[str, Path],
    out_dir: Path,
    model: nn.Module,
    examples: Sequence[_AttentionExample],
    options: ReportOptions,
    curves: Curves,
    curves_source: str | None,
) -> dict[str, Path]:
    """Attention maps and learning curves (both tasks end with them), then report.md; adds their files."""
    for k, path in enumerate(_attention_section(report, out_dir, model, examples, options)):
        files[f"attention_{k}"] = path
    _curves_section(report, out_dir, curves, curves_source)
    if (out_dir / "learning_curves.png").is_file():
        files["learning_curves"] = out_dir / "learning_curves.png"
    files["report"] = report.write(out_dir / "report.md")
    return files


# --- translation --------------------------------------------------------------------------------------


def write_translation_outputs(
    out_dir: str | Path,
    result: TranslationResult,
    *,
    info: Mapping[str, Any],
    decoding: Mapping[str, Any],
    model: nn.Module,
    encode_source: Callable[[str], list[int]],
    id_to_token: Callable[[int], str],
    curves: Curves,
    curves_source: str | None,
    options: ReportOptions,
    source_id_to_token: Callable[[int], str] | None = None,
) -> dict[str, Path]:
    """metrics.json, hypotheses.txt, predictions.tsv and (options.enabled) report.md + PNGs.

    `id_to_token` names target tokens, `source_id_to_token` source ones (default: the same, as with
    a joint vocabulary).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    buckets = bleu_by_length(result.sources, result.hypotheses, result.references, options.length_buckets)
    files = {
        "metrics": _write_json(
            out_dir / "metrics.json",
            {
                **_finite(result.metrics),
                **{f"{name}_signature": signature for name, signature in result.signatures.items()},
                "decoding": dict(decoding),
                "bleu_by_source_length": [
                    {"words": b.label, "count": b.count, "bleu": b.bleu} for b in buckets
                ],
                **info,
            },
        ),
        "hypotheses": out_dir / "hypotheses.txt",
        "predictions": _write_tsv(
            out_dir / "predictions.tsv",
            ["id", "source", "reference", "hypothesis", "sentence_bleu"],
            [
                [i, s, r, h, f"{b:.2f}"]
                for i, (s, r, h, b) in enumerate(
                    zip(result.sources, result.references, result.hypotheses, result.sentence_bleu)
                )
            ],
        ),
    }
    files["hypotheses"].write_text("".join(_one_line(h) + "\n" for h in result.hypotheses), encoding="utf-8")
    if not options.enabled:
        return files

    report = MarkdownReport(f"Evaluation: {Path(str(info.get('checkpoint', 'checkpoint'))).name}")
    _info_section(report, info)
    report.heading("Decoding")
    report.table(["setting", "value"], [[k, v] for k, v in decoding.items()])
    _metrics_section(report, result.metrics)
    report.code("\n".join(f"{name}: {signature}" for name, signature in result.signatures.items()))

    report.heading("BLEU by source length")
    report.table(["source words", "sentences", "BLEU"], [[b.label, b.count, b.bleu] for b in buckets])
    if buckets:
        files["bleu_by_length"] = save_bar_chart(
            [b.label for b in buckets],
            [b.bleu for b in buckets],
            out_dir / "bleu_by_length.png",
            title="BLEU by source length",
            xlabel="source words",
            ylabel="BLEU",
            counts=[b.count for b in buckets],
        )
        report.image(files["bleu_by_length"], "BLEU by source length", out_dir)

    order = sorted(range(len(result.hypotheses)), key=lambda i: (result.sentence_bleu[i], i))
    n = min(options.samples, len(order))
    header = ["id", "sentence BLEU", "source", "reference", "hypothesis"]
    best = sorted(range(len(result.hypotheses)), key=lambda i: (-result.sentence_bleu[i], i))
    for title, chosen in (("Best sentences", best[:n]), ("Worst sentences", order[:n])):
        report.heading(f"{title} (sentence BLEU)")
        report.table(
            header,
            [
                [i, result.sentence_bleu[i], result.sources[i], result.references[i], result.hypotheses[i]]
                for i in chosen
            ],
        )

    examples = []
    src_ids = {i: encode_source(result.sources[i]) for i in range(len(result.sources))}
    for i in _pick_examples(
        [len(src_ids[i]) for i in range(len(src_ids))],
        options.attention_examples,
        options.max_attention_tokens,
    ):
        hyp = result.hypothesis_ids[i] or [model.config.eos_id]
        tgt_in = [model.config.bos_id, *hyp[:-1]]  # what the decoder read while producing `hyp`
        source_tokens = [(source_id_to_token or id_to_token)(t) for t in src_ids[i]]
        examples.append((i, src_ids[i], source_tokens, tgt_in, [id_to_token(t) for t in hyp]))
    return _finish_report(report, files, out_dir, model, examples, options, curves, curves_source)


# --- classification -----------------------------------------------------------------------------------


def write_classification_outputs(
    out_dir: str | Path,
    result: ClassificationResult,
    *,
    info: Mapping[str, Any],
    texts: Sequence[str],
    model: nn.Module,
    encode_source: Callable[[str], list[int]],
    id_to_token: Callable[[int], str],
    curves: Curves,
    curves_source: str | None,
    options: ReportOptions,
) -> dict[str, Path]:
    """metrics.json, predictions.tsv and (options.enabled) report.md + PNGs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = result.class_names
    confidence = [p[pred] for p, pred in zip(result.probabilities, result.predictions)]
    files = {
        "metrics": _write_json(
            out_dir / "metrics.json",
            {
                **_finite(result.metrics),
                "per_class": result.per_class,
                "confusion_matrix": {"classes": names, "rows_gold_columns_predicted": result.confusion},
                **info,
            },
        ),
        "predictions": _write_tsv(
            out_dir / "predictions.tsv",
            ["id", "text", "label", "prediction", "confidence", *[f"p({name})" for name in names]],
            [
                [i, text, names[gold], names[pred], f"{conf:.4f}", *[f"{p:.4f}" for p in probs]]
                for i, (text, gold, pred, conf, probs) in enumerate(
                    zip(texts, result.labels, result.predictions, confidence, result.probabilities)
                )
            ],
        ),
    }
    if not options.enabled:
        return files

    report = MarkdownReport(f"Evaluation: {Path(str(info.get('checkpoint', 'checkpoint'))).name}")
    _info_section(report, info)
    _metrics_section(report, result.metrics)
    report.text("ece: expected calibration error of the top-class confidence (15 equal-width bins, L1).")
    report.heading("Per class")
    report.table(
        ["class", "precision", "recall", "F1", "support"],
        [
            [name, v["precision"], v["recall"], v["f1"], int(v["support"])]
            for name, v in result.per_class.items()
        ],
    )
    report.heading("Confusion matrix")
    files["confusion_matrix"] = save_confusion_matrix(
        result.confusion, names, out_dir / "confusion_matrix.png"
    )
    report.image(files["confusion_matrix"], "confusion matrix (rows: gold, columns: predicted)", out_dir)

    mistakes = [i for i, (gold, pred) in enumerate(zip(result.labels, result.predictions)) if gold != pred]
    mistakes.sort(key=lambda i: (-confidence[i], i))
    report.heading("Most confident mistakes")
    if mistakes:
        report.table(
            ["id", "confidence", "gold", "predicted", "text"],
            [
                [i, confidence[i], names[result.labels[i]], names[result.predictions[i]], texts[i]]
                for i in mistakes[: options.samples]
            ],
        )
    else:
        report.text("None: every example is classified correctly.")

    src_ids = [encode_source(text) for text in texts]
    chosen = _pick_examples(
        [len(ids) for ids in src_ids], options.attention_examples, options.max_attention_tokens
    )
    examples = [(i, src_ids[i], [id_to_token(t) for t in src_ids[i]], None, None) for i in chosen]
    return _finish_report(report, files, out_dir, model, examples, options, curves, curves_source)
