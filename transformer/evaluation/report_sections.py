"""report.md of `evaluate.py`: what goes into it (`ReportOptions`), what it draws on besides the scores
(`ReportInputs`) and its sections for each task, with the figures of `transformer.evaluation.plots`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from transformer.evaluation.directions import direction_section
from transformer.evaluation.lengths import LengthBucket
from transformer.evaluation.markdown import MarkdownReport, one_line
from transformer.evaluation.plots import (
    Curves,
    save_attention_heads,
    save_bar_chart,
    save_confusion_matrix,
    save_grouped_bar_chart,
    save_learning_curves,
)
from transformer.evaluation.scoring import ClassificationResult, TranslationResult, attention_maps

__all__ = ["ReportInputs", "ReportOptions", "write_classification_report", "write_translation_report"]


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


@dataclass(frozen=True)
class ReportInputs:
    """What the outputs draw on besides the scores: the run's description (`info`: the checkpoint, the
    data, the split; metrics.json and the report's first table), the model whose attention is drawn, how
    a source text becomes ids and ids become tokens (`source_id_to_token` for a separate source
    vocabulary; None: `id_to_token`), the training run's learning curves and where they came from, and
    what report.md holds (`options`)."""

    info: Mapping[str, Any]
    model: nn.Module
    encode_source: Callable[[str], list[int]]
    id_to_token: Callable[[int], str]
    source_id_to_token: Callable[[int], str] | None = None
    curves: Curves = field(default_factory=dict)
    curves_source: str | None = None
    options: ReportOptions = field(default_factory=ReportOptions)

    def source_token(self, token_id: int) -> str:
        return (self.source_id_to_token or self.id_to_token)(token_id)


# --- sections of both tasks ---------------------------------------------------------------------------


def _start_report(info: Mapping[str, Any]) -> MarkdownReport:
    """The title (the checkpoint's file name) and the checkpoint / data table."""
    report = MarkdownReport(f"Evaluation: {Path(str(info.get('checkpoint', 'checkpoint'))).name}")
    report.heading("Checkpoint and data")
    report.table(
        ["", ""], [[key, one_line(_cell(value))] for key, value in info.items() if value is not None]
    )
    return report


def _cell(value: Any) -> str:
    """A table cell: a mapping (an import's provenance) as `key: value` pairs, its unknown ones left out."""
    if isinstance(value, Mapping):
        return ", ".join(f"{key}: {item}" for key, item in value.items() if item is not None)
    return str(value)


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

_ATTENTION_TITLES = {
    "encoder_self": "encoder self-attention (rows: source tokens)",
    "decoder_self": "decoder self-attention (rows: output tokens, columns: decoder inputs)",
    "cross": "cross-attention (rows: output tokens, columns: source tokens)",
}


def _attention_section(
    report: MarkdownReport,
    out_dir: Path,
    model: nn.Module,
    examples: Sequence[_AttentionExample],
    options: ReportOptions,
) -> list[Path]:
    """Heatmaps per head for each (id, src ids, src tokens, tgt_in ids, output tokens) example."""
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
                title = f"example {index}: {_ATTENTION_TITLES[kind]}, layer {layer}"
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
    examples: Sequence[_AttentionExample],
    inputs: ReportInputs,
) -> dict[str, Path]:
    """Attention maps and learning curves (both tasks end with them), then report.md; adds their files."""
    attention = _attention_section(report, out_dir, inputs.model, examples, inputs.options)
    for k, path in enumerate(attention):
        files[f"attention_{k}"] = path
    _curves_section(report, out_dir, inputs.curves, inputs.curves_source)
    if (out_dir / "learning_curves.png").is_file():
        files["learning_curves"] = out_dir / "learning_curves.png"
    files["report"] = report.write(out_dir / "report.md")
    return files


# --- translation --------------------------------------------------------------------------------------


def write_translation_report(
    out_dir: Path,
    result: TranslationResult,
    buckets: Sequence[LengthBucket],
    by_direction: Mapping[str, Sequence[LengthBucket]],
    inputs: ReportInputs,
    decoding: Mapping[str, Any],
) -> dict[str, Path]:
    """report.md and its PNGs for a translation result; returns the files written, by kind."""
    report = _start_report(inputs.info)
    report.heading("Decoding")
    report.table(["setting", "value"], [[k, v] for k, v in decoding.items()])
    _metrics_section(report, result.metrics)
    report.code("\n".join(f"{name}: {signature}" for name, signature in result.signatures.items()))
    files = _bleu_by_length_section(report, out_dir, buckets)
    files |= _bleu_by_length_by_direction_section(report, out_dir, by_direction)
    if (chart := direction_section(report, result.metrics, "test", out_dir)) is not None:
        files["bleu_by_direction"] = chart
    _sentences_sections(report, result, inputs.options.samples)
    return _finish_report(report, files, out_dir, _translation_examples(result, inputs), inputs)


def _bleu_by_length_section(
    report: MarkdownReport, out_dir: Path, buckets: Sequence[LengthBucket]
) -> dict[str, Path]:
    report.heading("BLEU by source length")
    report.table(["source words", "sentences", "BLEU"], [[b.label, b.count, b.bleu] for b in buckets])
    if not buckets:
        return {}
    path = save_bar_chart(
        [b.label for b in buckets],
        [b.bleu for b in buckets],
        out_dir / "bleu_by_length.png",
        title="BLEU by source length",
        xlabel="source words",
        ylabel="BLEU",
        counts=[b.count for b in buckets],
    )
    report.image(path, "BLEU by source length", out_dir)
    return {"bleu_by_length": path}


def _bleu_by_length_by_direction_section(
    report: MarkdownReport, out_dir: Path, by_direction: Mapping[str, Sequence[LengthBucket]]
) -> dict[str, Path]:
    """A multilingual split's BLEU by source length, a column pair per direction and a grouped chart (a
    direction without sentences of a length: an empty cell, no bar)."""
    if not by_direction:
        return {}
    order = {(b.low, b.label): None for buckets in by_direction.values() for b in buckets}
    labels = [label for _, label in sorted(order)]
    found = {d: {b.label: b for b in buckets} for d, buckets in by_direction.items()}
    report.heading("BLEU by source length and direction")
    report.table(
        ["source words", *(f"{d} {name}" for d in by_direction for name in ("sentences", "BLEU"))],
        [
            [
                label,
                *(
                    cell
                    for d in by_direction
                    for cell in (
                        (found[d][label].count, found[d][label].bleu) if label in found[d] else ("", "")
                    )
                ),
            ]
            for label in labels
        ],
    )
    path = save_grouped_bar_chart(
        labels,
        {d: [found[d][label].bleu if label in found[d] else math.nan for label in labels] for d in found},
        out_dir / "bleu_by_length_by_direction.png",
        title="BLEU by source length and direction",
        xlabel="source words",
        ylabel="BLEU",
    )
    report.image(path, "BLEU by source length and direction", out_dir)
    return {"bleu_by_length_by_direction": path}


def _sentences_sections(report: MarkdownReport, result: TranslationResult, samples: int) -> None:
    """The `samples` best and worst sentences by sentence BLEU (ties: split order); the worst only among
    those below 100 (a perfect sentence is no mistake to show), saying so when they are fewer."""
    order = range(len(result.hypotheses))
    best = sorted(order, key=lambda i: (-result.sentence_bleu[i], i))[:samples]
    imperfect = [i for i in order if result.sentence_bleu[i] < 100.0]
    worst = sorted(imperfect, key=lambda i: (result.sentence_bleu[i], i))[:samples]
    report.heading("Best sentences (sentence BLEU)")
    _sentences_table(report, result, best)
    report.heading("Worst sentences (sentence BLEU)")
    if len(imperfect) < samples:
        fewer = (
            f"Only {len(imperfect)} of the {len(order)} sentences score"
            if imperfect
            else "No sentence scores"
        )
        report.text(f"{fewer} below 100 (the others score 100).")
    _sentences_table(report, result, worst)


def _sentences_table(report: MarkdownReport, result: TranslationResult, chosen: Sequence[int]) -> None:
    if chosen:
        report.table(
            ["id", "sentence BLEU", "source", "reference", "hypothesis"],
            [
                [i, result.sentence_bleu[i], result.sources[i], result.references[i], result.hypotheses[i]]
                for i in chosen
            ],
        )


def _translation_examples(result: TranslationResult, inputs: ReportInputs) -> list[_AttentionExample]:
    """Short sentences with the decoder inputs that produced their hypotheses."""
    src_ids = [inputs.encode_source(source) for source in result.sources]
    config, options = inputs.model.config, inputs.options
    chosen = _pick_examples(
        [len(ids) for ids in src_ids], options.attention_examples, options.max_attention_tokens
    )
    examples = []
    for i in chosen:
        hyp = result.hypothesis_ids[i] or [config.eos_id]
        tgt_in = [config.bos_id, *hyp[:-1]]  # what the decoder read while producing `hyp`
        source_tokens = [inputs.source_token(t) for t in src_ids[i]]
        examples.append((i, src_ids[i], source_tokens, tgt_in, [inputs.id_to_token(t) for t in hyp]))
    return examples


# --- classification -----------------------------------------------------------------------------------


def write_classification_report(
    out_dir: Path, result: ClassificationResult, inputs: ReportInputs, texts: Sequence[str]
) -> dict[str, Path]:
    """report.md and its PNGs for a classification result; returns the files written, by kind."""
    report = _start_report(inputs.info)
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
    path = save_confusion_matrix(result.confusion, result.class_names, out_dir / "confusion_matrix.png")
    report.image(path, "confusion matrix (rows: gold, columns: predicted)", out_dir)
    options = inputs.options
    _mistakes_section(report, result, texts, options.samples)

    src_ids = [inputs.encode_source(text) for text in texts]
    chosen = _pick_examples(
        [len(ids) for ids in src_ids], options.attention_examples, options.max_attention_tokens
    )
    examples = [(i, src_ids[i], [inputs.id_to_token(t) for t in src_ids[i]], None, None) for i in chosen]
    return _finish_report(report, {"confusion_matrix": path}, out_dir, examples, inputs)


def _mistakes_section(
    report: MarkdownReport, result: ClassificationResult, texts: Sequence[str], samples: int
) -> None:
    """The `samples` wrong predictions made with the highest confidence (ties: split order)."""
    names, confidence = result.class_names, result.confidence
    mistakes = [i for i, (gold, pred) in enumerate(zip(result.labels, result.predictions)) if gold != pred]
    mistakes.sort(key=lambda i: (-confidence[i], i))
    report.heading("Most confident mistakes")
    if not mistakes:
        report.text("None: every example is classified correctly.")
        return
    report.table(
        ["id", "confidence", "gold", "predicted", "text"],
        [
            [i, confidence[i], names[result.labels[i]], names[result.predictions[i]], texts[i]]
            for i in mistakes[:samples]
        ],
    )
