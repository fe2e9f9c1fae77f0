"""Evaluation reports: Markdown tables, PNG figures, learning curves read back from training logs, and
the files `write_translation_outputs` / `write_classification_outputs` leave in an output directory."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.reports import assert_png, assert_valid_markdown, cells
from transformer.config import TransformerConfig
from transformer.evaluation.plots import (
    read_learning_curves,
    save_attention_heads,
    save_bar_chart,
    save_confusion_matrix,
    save_learning_curves,
)
from transformer.evaluation.reports import (
    MarkdownReport,
    ReportInputs,
    ReportOptions,
    markdown_table,
    write_classification_outputs,
    write_translation_outputs,
)
from transformer.evaluation.scoring import ClassificationResult, TranslationResult
from transformer.model import Seq2SeqTransformer, TransformerClassifier

# --- Markdown ------------------------------------------------------------------------------------------


def test_markdown_table_escapes_cells() -> None:
    table = markdown_table(["a", "b"], [["x | y", 1.23456], ["line\nbreak", "back\\slash"]])
    rows = table.splitlines()
    assert rows[0] == "| a | b |" and rows[1] == "|---|---|"
    assert [len(cells(r)) for r in rows] == [2, 2, 2, 2]
    assert "x \\| y" in rows[2] and "1.23" in rows[2]
    assert "line break" in rows[3]
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        markdown_table(["a", "b"], [["only one"]])


def test_markdown_report(tmp_path: Path) -> None:
    image = save_bar_chart(["x"], [1.0], tmp_path / "figs" / "bar.png", title="t", xlabel="x", ylabel="y")
    report = MarkdownReport("Title")
    report.heading("Section")
    report.table(["k", "v"], [["a", 1]])
    report.code("has ``` inside")
    report.image(image, "a bar", tmp_path)
    text = assert_valid_markdown(report.write(tmp_path / "report.md"))
    assert "![a bar](figs/bar.png)" in text
    assert "````\nhas ``` inside\n````" in text


# --- figures -------------------------------------------------------------------------------------------


def test_attention_heads_png(tmp_path: Path) -> None:
    weights = torch.softmax(torch.randn(3, 4, 5), dim=-1).numpy()  # (H, Tq, Tk)
    path = save_attention_heads(weights, list("abcd"), list("vwxyz"), tmp_path / "att.png", "title")
    assert_png(path)
    with pytest.raises(ValueError, match=r"weights must be \(heads, 4 queries, 6 keys\)"):
        save_attention_heads(weights, list("abcd"), list("uvwxyz"), tmp_path / "bad.png", "title")


def test_confusion_matrix_and_bar_chart_png(tmp_path: Path) -> None:
    assert_png(save_confusion_matrix([[5, 1, 0], [2, 7, 1], [0, 0, 9]], ["a", "b", "c"], tmp_path / "cm.png"))
    with pytest.raises(ValueError, match=r"must be \(2, 2\)"):
        save_confusion_matrix([[1, 2, 3]], ["a", "b"], tmp_path / "bad.png")
    chart = save_bar_chart(
        ["1-5", "6-10"], [12.5, 30.1], tmp_path / "bars.png", title="t", xlabel="x", ylabel="y", counts=[3, 4]
    )
    assert_png(chart)


def _write_lightning_csv(path: Path) -> None:
    """What Lightning's CSVLogger writes: one row per logging call, empty cells elsewhere."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ["epoch", "lr-AdamW/pg1", "step", "train/loss", "val/loss", "val/bleu", "test/bleu"]
    rows = [
        ["0", "0.001", "9", "5.0", "", "", ""],
        ["0", "", "9", "", "4.5", "3.0", ""],
        ["1", "0.002", "19", "4.0", "", "", ""],
        ["1", "", "19", "", "3.5", "7.5", ""],
        ["2", "0.0015", "29", "3.0", "", "", ""],
        ["", "", "29", "", "", "", "9.0"],
    ]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def test_learning_curves_from_csv_logs(tmp_path: Path) -> None:
    _write_lightning_csv(tmp_path / "run" / "csv" / "metrics.csv")
    curves = read_learning_curves(tmp_path / "run")
    assert curves["train/loss"] == [(9, 5.0), (19, 4.0), (29, 3.0)]
    assert curves["val/bleu"] == [(9, 3.0), (19, 7.5)]
    assert curves["test/bleu"] == [(29, 9.0)]
    assert "epoch" not in curves and "step" not in curves
    assert_png(save_learning_curves(curves, tmp_path / "curves.png"))
    assert read_learning_curves(tmp_path / "nowhere") == {}
    # single points (test metrics) alone are not curves
    assert save_learning_curves({"test/bleu": [(29, 9.0)]}, tmp_path / "none.png") is None


def test_learning_curves_from_tensorboard_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "run" / "tensorboard"))
    for step in range(5):
        writer.add_scalar("train/loss", 5.0 - step, step)
        writer.add_scalar("val/acc", 0.1 * step, step)
    writer.close()
    curves = read_learning_curves(tmp_path / "run")
    assert curves["train/loss"] == [(s, 5.0 - s) for s in range(5)]
    assert [round(v, 5) for _, v in curves["val/acc"]] == [0.0, 0.1, 0.2, 0.3, 0.4]


# --- output directories ----------------------------------------------------------------------------------


def _tiny_config(**overrides: object) -> TransformerConfig:
    values = {"src_vocab_size": 20, "d_model": 16, "n_heads": 2, "n_encoder_layers": 2, "n_decoder_layers": 1}
    return TransformerConfig(**{**values, "d_ff": 32, "dropout": 0.0, **overrides})


def _token(i: int) -> str:
    return {0: "<pad>", 1: "<s>", 2: "</s>"}.get(i, f"w{i}")


def _encode(text: str) -> list[int]:
    return [1, *(4 + sum(map(ord, w)) % 16 for w in text.split()), 2]


def _inputs(options: ReportOptions, *, classifier: bool = False, **values: Any) -> ReportInputs:
    """ReportInputs over a tiny untrained model (a translation model, or a 2-class classifier) with this
    module's token functions; `values`: info, curves, curves_source."""
    model = (
        TransformerClassifier(_tiny_config(n_decoder_layers=0, tie_embeddings="none"), 2)
        if classifier
        else Seq2SeqTransformer(_tiny_config())
    )
    values = {"info": {}, **values}
    return ReportInputs(model=model, encode_source=_encode, id_to_token=_token, options=options, **values)


def test_translation_outputs(tmp_path: Path) -> None:
    sources = ["1 2 3", "4 5", "6 7 8 9 10 11 12", "1 | 2"]
    references = ["a b c", "d e", "f g h i", "x | y"]
    hypotheses = ["a b c", "d x", "f g h j", "x | y"]
    result = TranslationResult(
        metrics={"test/bleu": 51.2, "test/chrf": 60.0, "test/loss": 1.5},
        signatures={"bleu": "nrefs:1|tok:13a", "chrf": "nrefs:1|nc:6"},
        sources=sources,
        references=references,
        hypotheses=hypotheses,
        hypothesis_ids=[[5, 6, 7, 2], [5, 2], [], [8, 9, 2]],
        sentence_bleu=[100.0, 0.0, 30.0, 100.0],
    )
    _write_lightning_csv(tmp_path / "run" / "csv" / "metrics.csv")
    out = tmp_path / "out"
    out.mkdir()
    files = write_translation_outputs(
        out,
        result,
        _inputs(
            ReportOptions(attention_examples=2, length_buckets=[3, 5]),
            info={"task": "translation", "checkpoint": "/x/epoch_003.ckpt", "split": "test"},
            curves=read_learning_curves(tmp_path / "run"),
            curves_source=str(tmp_path / "run"),
        ),
        decoding={"search": "auto", "beam_size": 1},
    )
    assert (out / "hypotheses.txt").read_text().splitlines() == hypotheses
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["test/bleu"] == 51.2 and metrics["bleu_signature"] == "nrefs:1|tok:13a"
    assert metrics["decoding"] == {"search": "auto", "beam_size": 1} and metrics["split"] == "test"
    assert [b["words"] for b in metrics["bleu_by_source_length"]] == ["1-3", "6+"]
    with (out / "predictions.tsv").open(newline="") as handle:
        rows = list(csv.reader(handle, delimiter="\t"))
    assert rows[0] == ["id", "source", "reference", "hypothesis", "sentence_bleu"]
    assert rows[4] == ["3", "1 | 2", "x | y", "x | y", "100.00"]
    text = assert_valid_markdown(files["report"])
    assert "# Evaluation: epoch_003.ckpt" in text
    assert "## Best sentences" in text and "## Worst sentences" in text
    assert "![learning curves](learning_curves.png)" in text
    attention = sorted(p.name for p in (out / "attention").iterdir())
    # two examples x (encoder self, decoder self, cross) x the top layer; the empty hypothesis draws too
    assert len(attention) == 6 and all("layer" in name for name in attention)
    for path in files.values():
        if path.suffix == ".png":
            assert_png(path)


def test_a_multilingual_report_splits_bleu_by_length_by_direction(tmp_path: Path) -> None:
    directions = ["en-de", "en-fr", "en-fr", "en-de"]
    result = TranslationResult(
        {"test/bleu": 1.0},
        {"bleu": "b", "chrf": "c"},
        [">>de<< 1 2 3", ">>fr<< 4 5", ">>fr<< 6 7 8 9 10 11", ">>de<< 1 2 3 4 5 6 7"],
        ["a b c", "d e", "f g h i", "x y"],
        ["a b c", "d x", "f g h j", "x y"],
        [[2]] * 4,
        [100.0, 0.0, 30.0, 100.0],
        directions=directions,
        source_labels=[">>de<<", ">>fr<<"],
    )
    files = write_translation_outputs(
        tmp_path,
        result,
        _inputs(ReportOptions(attention_examples=0, length_buckets=[3, 5])),
        decoding={},
    )
    saved = json.loads(files["metrics"].read_text())
    assert [(b["words"], b["count"]) for b in saved["bleu_by_source_length"]] == [("1-3", 2), ("6+", 2)]
    by_direction = saved["bleu_by_source_length_by_direction"]
    assert [(b["words"], b["count"]) for b in by_direction["en-de"]] == [("1-3", 1), ("6+", 1)]
    assert [(b["words"], b["count"]) for b in by_direction["en-fr"]] == [("1-3", 1), ("6+", 1)]
    text = assert_valid_markdown(files["report"])
    assert "## BLEU by source length and direction" in text
    assert "| source words | en-de sentences | en-de BLEU | en-fr sentences | en-fr BLEU |" in text
    assert_png(files["bleu_by_length_by_direction"])


def test_translation_outputs_without_report(tmp_path: Path) -> None:
    result = TranslationResult(
        {"test/bleu": 1.0}, {"bleu": "b", "chrf": "c"}, ["s"], ["r"], ["h"], [[2]], [0.0]
    )
    files = write_translation_outputs(
        tmp_path,
        result,
        _inputs(ReportOptions(enabled=False), curves={}, curves_source=None),
        decoding={},
    )
    assert sorted(files) == ["hypotheses", "metrics", "predictions"]
    assert not (tmp_path / "report.md").exists()


def test_classification_outputs(tmp_path: Path) -> None:
    result = ClassificationResult(
        metrics={"test/acc": 0.5, "test/f1": 0.4, "test/loss": 0.7, "test/ece": 0.1},
        class_names=["neg", "pos"],
        per_class={
            "neg": {"precision": 1.0, "recall": 0.5, "f1": 0.67, "support": 2.0},
            "pos": {"precision": 0.5, "recall": 1.0, "f1": 0.67, "support": 2.0},
        },
        confusion=[[1, 1], [0, 2]],
        labels=[0, 0, 1, 1],
        predictions=[0, 1, 1, 1],
        probabilities=[[0.9, 0.1], [0.2, 0.8], [0.4, 0.6], [0.3, 0.7]],
    )
    files = write_classification_outputs(
        tmp_path,
        result,
        _inputs(
            ReportOptions(samples=3, attention_examples=1, attention_layers=[0, -1]),
            classifier=True,
            info={"task": "classification", "checkpoint": "c.ckpt"},
            curves={},
            curves_source=None,
        ),
        texts=["1 2", "3 4 5", "6", "7 8"],
    )
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["test/acc"] == 0.5
    assert metrics["confusion_matrix"]["rows_gold_columns_predicted"] == [[1, 1], [0, 2]]
    with (tmp_path / "predictions.tsv").open(newline="") as handle:
        rows = list(csv.reader(handle, delimiter="\t"))
    assert rows[0] == ["id", "text", "label", "prediction", "confidence", "p(neg)", "p(pos)"]
    assert rows[2] == ["1", "3 4 5", "neg", "pos", "0.8000", "0.2000", "0.8000"]
    text = assert_valid_markdown(files["report"])
    # the one mistake (id 1, confidence 0.8) is listed; learning curves are missing and say so
    assert re.search(r"\| 1 \| 0\.80 \| neg \| pos \| 3 4 5 \|", text)
    assert "No learning curves" in text
    assert_png(files["confusion_matrix"])
    assert sorted(p.name for p in (tmp_path / "attention").iterdir()) == [
        "example0_encoder_self_layer0.png",
        "example0_encoder_self_layer1.png",
    ]
    with pytest.raises(ValueError, match="layer 5 does not exist"):
        write_classification_outputs(
            tmp_path / "again",
            result,
            _inputs(ReportOptions(attention_layers=[5]), classifier=True, curves={}, curves_source=None),
            texts=["1", "2", "3", "4"],
        )


def test_worst_sentences_are_only_the_imperfect_ones() -> None:
    """The worst sentences never pad with perfect ones (sentence BLEU 100); fewer than asked are named."""
    from transformer.evaluation.report_sections import _sentences_sections

    bleu = [100.0, 0.0, 30.0, 100.0, 100.0]
    n = len(bleu)
    result = TranslationResult({}, {}, [f"s{i}" for i in range(n)], ["r"] * n, ["h"] * n, [[2]] * n, bleu)
    report = MarkdownReport("r")
    _sentences_sections(report, result, samples=3)
    worst = report.to_markdown().split("## Worst sentences (sentence BLEU)")[1]
    assert "Only 2 of the 5 sentences score below 100" in worst
    assert [cells(line)[0].strip() for line in worst.splitlines() if line.startswith("| ")][1:] == ["1", "2"]

    perfect = TranslationResult({}, {}, ["s"], ["r"], ["r"], [[2]], [100.0])
    report = MarkdownReport("r")
    _sentences_sections(report, perfect, samples=3)
    worst = report.to_markdown().split("## Worst sentences (sentence BLEU)")[1]
    assert "No sentence scores below 100" in worst and "| 0 |" not in worst


def test_ties_in_sentence_bleu_keep_the_splits_order() -> None:
    from transformer.evaluation.report_sections import _sentences_sections

    bleu = [50.0, 20.0, 50.0, 20.0, 100.0, 50.0]
    n = len(bleu)
    result = TranslationResult({}, {}, [f"s{i}" for i in range(n)], ["r"] * n, ["h"] * n, [[2]] * n, bleu)
    report = MarkdownReport("r")
    _sentences_sections(report, result, samples=3)
    best, worst = report.to_markdown().split("## Best sentences (sentence BLEU)")[1].split("## Worst")

    def ids(section: str) -> list[str]:
        return [cells(line)[0].strip() for line in section.splitlines() if line.startswith("| ")][1:]

    assert ids(best) == ["4", "0", "2"] and ids(worst) == ["1", "3", "0"]
