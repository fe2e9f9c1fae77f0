"""The table of final metrics `train.py` prints at its end (`transformer.cli.results.print_metrics`)."""

from __future__ import annotations

import pytest

from transformer.cli.results import number, print_metrics


def test_small_values_keep_their_digits(capsys: pytest.CaptureFixture[str]) -> None:
    """The learning rate at the end of a run (issue 51: it printed 0.0000)."""
    metrics = {"lr-AdamW": 0.00032, "test/bleu": 41.35179, "train/loss": 0.0, "epoch": 5, "best": None}
    print_metrics(metrics, "run directory: runs/x")
    assert capsys.readouterr().out.splitlines() == [
        "best        None",
        "epoch       5",
        "lr-AdamW    3.20e-04",
        "test/bleu   41.3518",
        "train/loss  0.0000",
        "run directory: runs/x",
    ]


def test_numbers_have_four_decimals_or_three_significant_digits_when_smaller() -> None:
    assert [number(v) for v in (1.5, -2.25, 0.0, 0.01)] == ["1.5000", "-2.2500", "0.0000", "0.0100"]
    assert [number(v) for v in (3.2e-4, -3.2e-3, 1e-9)] == ["3.20e-04", "-3.20e-03", "1.00e-09"]
