"""Issue 65 item 2: scores per direction. Each direction's corpus scores equal sacreBLEU's on its sentences
alone, the plain names are their mean, the printed table has one row per direction, and a single direction
keeps the bilingual scores and printout exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import sacrebleu

from transformer.cli.results import print_metrics
from transformer.evaluation.directions import direction_rows, direction_table, directions_in
from transformer.evaluation.plots import save_learning_curves
from transformer.evaluation.scoring import corpus_scores, direction_scores

HYPOTHESES = ["ein Hund läuft .", "zwei Katzen", "un chien court .", "deux chats noirs", "trois oiseaux"]
REFERENCES = ["ein Hund läuft .", "zwei Katzen schlafen", "un chien court .", "deux chats", "trois oiseaux"]
DIRECTIONS = ["en-de", "en-de", "en-fr", "en-fr", "en-fr"]


def test_each_direction_is_scored_alone_and_the_plain_names_are_their_mean() -> None:
    scores = direction_scores(HYPOTHESES, REFERENCES, DIRECTIONS)
    for direction, rows in (("en-de", [0, 1]), ("en-fr", [2, 3, 4])):
        hyps, refs = [HYPOTHESES[i] for i in rows], [REFERENCES[i] for i in rows]
        bleu = sacrebleu.BLEU(force=True).corpus_score(hyps, [refs]).score
        chrf = sacrebleu.CHRF().corpus_score(hyps, [refs]).score
        assert scores[f"bleu_{direction}"] == pytest.approx(bleu)
        assert scores[f"chrf_{direction}"] == pytest.approx(chrf)
        assert scores[f"exact_match_{direction}"] == pytest.approx(
            100 * sum(h == r for h, r in zip(hyps, refs)) / len(rows)
        )
        assert scores[f"n_sentences_{direction}"] == len(rows)
    for name in ("bleu", "bleu_lc", "chrf", "exact_match"):
        assert scores[name] == pytest.approx((scores[f"{name}_en-de"] + scores[f"{name}_en-fr"]) / 2)
    # a mean over directions, not the corpus score of all sentences together
    assert scores["bleu"] != pytest.approx(corpus_scores(HYPOTHESES, REFERENCES)["bleu"])


def test_one_direction_equals_the_bilingual_scores() -> None:
    scores = direction_scores(HYPOTHESES, REFERENCES, ["en-de"] * 5)
    plain = corpus_scores(HYPOTHESES, REFERENCES)
    assert {k: scores[k] for k in plain} == plain


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="5 hypotheses, 5 references and 2 directions"):
        direction_scores(HYPOTHESES, REFERENCES, DIRECTIONS[:2])


def test_printed_table_has_one_row_per_direction(capsys: pytest.CaptureFixture[str]) -> None:
    metrics = {f"test/{k}": v for k, v in direction_scores(HYPOTHESES, REFERENCES, DIRECTIONS).items()}
    assert directions_in(metrics, "test") == ["en-de", "en-fr"]
    assert [row[:2] for row in direction_rows(metrics, "test")] == [["en-de", 2], ["en-fr", 3]]
    print_metrics(metrics, "done")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["direction", "sentences", "bleu", "chrf", "exact_match"]
    assert lines[1].split()[:2] == ["en-de", "2"] and lines[2].split()[:2] == ["en-fr", "3"]
    assert float(lines[2].split()[2]) == pytest.approx(metrics["test/bleu_en-fr"], abs=0.006)
    bilingual = {f"test/{k}": v for k, v in corpus_scores(HYPOTHESES, REFERENCES).items()}
    assert direction_table(bilingual, "test") == ""
    print_metrics(bilingual, "done")
    assert capsys.readouterr().out.splitlines()[0].startswith("test/bleu ")  # unchanged: no table first


def test_learning_curves_draw_each_direction_in_its_metric_panel(tmp_path: Path) -> None:
    curves = {"val/bleu_en-de": [(10, 1.0), (20, 5.0)], "val/chrf_en-fr": [(10, 9.0), (20, 30.0)]}
    assert save_learning_curves(curves, tmp_path / "curves.png") == tmp_path / "curves.png"
    assert save_learning_curves({"val/bleu_best": [(10, 1.0), (20, 2.0)]}, tmp_path / "none.png") is None
