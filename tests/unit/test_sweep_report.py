"""transformer.evaluation.sweep_report on hand-made sweep directories: override parsing, swept keys, mean ±
std over seeds, failed jobs, the files it writes and the command line."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import yaml

from transformer.evaluation.sweep_report import (
    group_jobs,
    main,
    parse_override,
    read_jobs,
    swept_keys,
    write_report,
)


def _job(sweep: Path, name: str, overrides: list[str], metrics: dict | None, objective: str | None = None):
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if objective is not None:
        (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"optimized_metric": objective}))
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))
    return job


@pytest.fixture
def grid(tmp_path: Path) -> Path:
    """A 2 (lr) x 2 (seed) grid plus a third seed that failed, as train.py leaves it on disk."""
    sweep = tmp_path / "multirun"
    scores = {("0.001", 1): 20.0, ("0.001", 2): 22.0, ("0.01", 1): 10.0, ("0.01", 2): 14.0}
    for i, ((lr, seed), bleu) in enumerate(scores.items()):
        metrics = {"val/bleu_best": bleu, "test/bleu": bleu - 1, "val/loss": None, "run_dir": "x", "epoch": 3}
        _job(sweep, str(i), ["trainer.max_epochs=3", f"model.optimizer.lr={lr}", f"seed={seed}"], metrics,
             objective="val/bleu_best")  # fmt: skip
    _job(sweep, "10", ["trainer.max_epochs=3", "model.optimizer.lr=0.01", "seed=3"], None)
    return sweep


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("model.config.d_model=128", ("model.config.d_model", 128)),
        ("model.optimizer.lr=1.2e-05", ("model.optimizer.lr", 1.2e-05)),
        ("++trainer.enable_progress_bar=False", ("trainer.enable_progress_bar", False)),
        ("+callbacks.x=null", ("callbacks.x", None)),
        ("experiment=sst2", ("experiment", "sst2")),
        ("logger=[csv,wandb]", ("logger", "[csv,wandb]")),
        ("data.data_dir='/a b/c'", ("data.data_dir", "/a b/c")),
        ("name=a=b", ("name", "a=b")),
    ],
)
def test_parse_override(text: str, expected: tuple) -> None:
    assert parse_override(text) == expected


def test_parse_override_rejects_a_bare_word() -> None:
    with pytest.raises(ValueError, match="key=value"):
        parse_override("seed")


def test_jobs_in_natural_order_with_failures_kept(grid: Path) -> None:
    jobs = read_jobs(grid)
    assert [j.path.name for j in jobs] == ["0", "1", "2", "3", "10"]  # 10 after 3, not after 1
    assert [j.finished for j in jobs] == [True] * 4 + [False]
    assert jobs[0].overrides == {"trainer.max_epochs": 3, "model.optimizer.lr": 0.001, "seed": 1}
    assert jobs[0].metrics == {"val/bleu_best": 20.0, "test/bleu": 19.0, "val/loss": None, "epoch": 3.0}


def test_swept_keys_leave_out_what_every_job_shares(grid: Path) -> None:
    jobs = read_jobs(grid)
    assert swept_keys(jobs) == ["model.optimizer.lr", "seed"]
    jobs[0].overrides["extra"] = 1  # a key only some jobs have is swept too
    assert swept_keys(jobs) == ["model.optimizer.lr", "seed", "extra"]


def test_mean_and_std_over_seeds_of_otherwise_identical_jobs(grid: Path) -> None:
    jobs = read_jobs(grid)
    groups = group_jobs(jobs, ["model.optimizer.lr", "seed"], ["val/bleu_best", "val/loss"], seed_key="seed")
    assert [g.params for g in groups] == [{"model.optimizer.lr": 0.001}, {"model.optimizer.lr": 0.01}]
    assert [len(g.jobs) for g in groups] == [2, 3]  # the failed seed belongs to its group
    assert groups[0].stats["val/bleu_best"] == (21.0, pytest.approx(statistics.stdev([20, 22])), 2)
    assert groups[1].stats["val/bleu_best"] == (12.0, pytest.approx(statistics.stdev([10, 14])), 2)
    assert "val/loss" not in groups[0].stats  # null everywhere: no statistic
    single = group_jobs(jobs[:1], [], ["val/bleu_best"], seed_key="seed")
    assert single[0].stats["val/bleu_best"] == (20.0, None, 1)


def test_write_report_files(grid: Path, tmp_path: Path) -> None:
    written = write_report(grid, tmp_path / "out")
    assert {k: p.name for k, p in written.items()} == {
        "jobs_csv": "jobs.csv",
        "summary_csv": "summary.csv",
        "plot": "val_bleu_best_vs_params.png",
        "report": "report.md",
    }
    rows = list(csv.DictReader(written["jobs_csv"].open()))
    assert list(rows[0]) == [
        "job",
        "status",
        "model.optimizer.lr",
        "seed",
        "val/bleu_best",
        "test/bleu",
        "val/loss",
    ]
    assert [r["status"] for r in rows] == ["done"] * 4 + ["failed"]
    assert rows[4]["val/bleu_best"] == "" and rows[2]["val/bleu_best"] == "10.0"
    summary = list(csv.DictReader(written["summary_csv"].open()))
    assert [(r["model.optimizer.lr"], r["jobs"], r["finished"]) for r in summary] == [
        ("0.001", "2", "2"),
        ("0.01", "3", "2"),
    ]
    assert float(summary[1]["val/bleu_best mean"]) == 12.0
    assert float(summary[1]["val/bleu_best std"]) == pytest.approx(statistics.stdev([10, 14]))
    markdown = written["report"].read_text()
    assert "Objective: `val/bleu_best`" in markdown and "`trainer.max_epochs=3`" in markdown
    assert "| 0.01 | 2/3 | 12 ± 2.8 |" in markdown
    assert "![val/bleu_best against the swept parameters](val_bleu_best_vs_params.png)" in markdown
    assert written["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_categorical_parameters_and_chosen_metrics(tmp_path: Path) -> None:
    for i, (experiment, acc) in enumerate([("sst2", 0.8), ("sst2_small", 0.7), ("sst2", 0.82)]):
        _job(tmp_path, str(i), [f"experiment={experiment}", f"seed={i}"], {"val/acc": acc, "test/acc": acc})
    written = write_report(tmp_path, metric="val/acc", metrics=["test/acc"])
    header = next(csv.reader(written["jobs_csv"].open()))
    assert header == ["job", "status", "experiment", "seed", "val/acc", "test/acc"]
    assert written["plot"].name == "val_acc_vs_params.png"


def test_command_line(grid: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(grid), "--out", str(tmp_path / "cli"), "--metrics", "test/bleu"]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == [
        "jobs.csv",
        "report.md",
        "summary.csv",
        "val_bleu_best_vs_params.png",
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 1
    assert "no job directories" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_malformed_files_name_the_file(tmp_path: Path) -> None:
    job = _job(tmp_path, "0", ["seed=1"], None)
    (job / "metrics.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"metrics\.json"):
        read_jobs(tmp_path)
    (job / ".hydra" / "overrides.yaml").write_text("seed: 1\n")
    with pytest.raises(ValueError, match=r"overrides\.yaml.*list"):
        read_jobs(tmp_path)


def _table_header(markdown: str, heading: str) -> list[str]:
    lines = markdown.split(f"## {heading}\n\n", 1)[1].splitlines()
    return [cell.strip() for cell in lines[0].strip("|").split("|")]


def test_report_tables_keep_only_the_metrics_that_differ(tmp_path: Path) -> None:
    """report.md: the metrics equal in every job go to one line, the objective stays (even if equal);
    the status column only when a job is not done; jobs.csv keeps every column."""
    constant = {"val/bleu_best": 30.0, "test/n_sentences": 128.0, "val/n_sentences": 128.0}
    for i, (lr, bleu) in enumerate([(0.001, 25.0), (0.002, 27.0), (0.003, 26.0)]):
        _job(tmp_path, str(i), [f"model.optimizer.lr={lr}"], {**constant, "test/bleu": bleu},
             objective="val/bleu_best")  # fmt: skip
    written = write_report(tmp_path, tmp_path / "out")
    markdown = written["report"].read_text()
    assert _table_header(markdown, "Jobs") == ["job", "model.optimizer.lr", "val/bleu_best", "test/bleu"]
    assert "Same in every finished job" in markdown and "`test/n_sentences=128`" in markdown
    assert next(csv.reader(written["jobs_csv"].open())) == [
        "job", "status", "model.optimizer.lr", "val/bleu_best", "test/bleu", "test/n_sentences",
        "val/n_sentences",
    ]  # fmt: skip

    _job(tmp_path, "3", ["model.optimizer.lr=0.004"], None)  # a failed job: the status matters now
    markdown = write_report(tmp_path, tmp_path / "out")["report"].read_text()
    assert _table_header(markdown, "Jobs")[:2] == ["job", "status"] and "| 3 | failed |" in markdown
