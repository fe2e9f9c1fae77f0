"""evaluate.py end to end on checkpoints of real (tiny) training runs made with train.py: scores.

Scores equal the training run's own test step (translation and classification); wandb gets the metrics and
the report's images; any split of local Multi30k files; beam 1 equals greedy; a quick subset scores the
split's first sentences; decoding sweeps; pretraining then fine-tuning through the command line; a GPU
checkpoint evaluates on the CPU. Translating text and bad input: test_evaluate_translate.py and
test_evaluate_errors.py.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import sacrebleu
import torch

from tests.helpers import evaluate_runs, trained
from tests.helpers.evaluate_runs import CLOSE, EXACT, best_checkpoint, read_metrics, run_in_project
from tests.helpers.refusals import snapshot
from tests.helpers.reports import assert_png, assert_valid_markdown
from tests.helpers.sst import TINY_SST, write_sst
from tests.helpers.trained import train_run

# in-process evaluations of tiny models: one thread is several times faster on a busy 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

# the session's tiny runs (tests/helpers/trained.py), shared with other modules of this test process
translation_run, classification_run = trained.translation_run, trained.classification_run
compose_eval = evaluate_runs.compose_eval


def test_pretrain_then_fine_tune(tmp_path: Path) -> None:
    """experiment=sst2_pretrain, then experiment=sst2 model.init_from=<its checkpoint>; a pretraining
    checkpoint is refused by evaluate.py, and one of another tokenizer by init_from, before any file."""
    data, cache = write_sst(tmp_path / "data"), tmp_path / "cache"
    tiny = [f"data.data_dir={data}", *TINY_SST, "data.max_len=16", "model.config.max_len=16"]
    pre = train_run(tmp_path / "pre", cache, ["experiment=sst2_pretrain", *tiny])
    pre_metrics = read_metrics(pre)
    assert pre_metrics["val/loss_best"] == pytest.approx(min(_csv_column(pre, "val/loss")))
    assert "test/loss" in pre_metrics
    ckpt = pre / "checkpoints" / "last.ckpt"
    fine = run_in_project(
        "train.py",
        [f"hydra.run.dir={tmp_path / 'fine'}", f"paths.cache_dir={cache}", "logger=csv", "experiment=sst2",
         *tiny, f"model.init_from={ckpt}"],
    )  # fmt: skip
    assert fine.returncode == 0, fine.stderr[-3000:]
    log_text = (tmp_path / "fine" / "train.log").read_text()
    # the embedding and one post-LN layer (attention 4, feed-forward 4, norms 4); no final norm after post-LN
    assert f"Initialized 13 encoder tensors from {ckpt}" in log_text
    assert "test/acc" in read_metrics(tmp_path / "fine")
    evaluated = run_in_project("evaluate.py", [f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'eval'}"])
    assert evaluated.returncode == 1
    assert "masked-LM pretraining checkpoint" in evaluated.stderr.splitlines()[-1]
    other = run_in_project(
        "train.py",
        [f"hydra.run.dir={tmp_path / 'other'}", f"paths.cache_dir={cache}", "logger=csv", "experiment=sst2",
         *tiny, "data.vocab_size=90", f"model.init_from={ckpt}"],
    )  # fmt: skip
    assert other.returncode == 1
    assert other.stderr.rstrip().splitlines()[-1].startswith(f"error: model.init_from={ckpt} was pretrained")
    assert not any((tmp_path / "other" / name).exists() for name in ("checkpoints", "config.yaml"))


def _synthetic_references(checkpoint: Path) -> list[str]:
    """The test references of a run on the synthetic task, generated again from the data settings saved
    in its checkpoint (not read back from anything evaluate.py wrote)."""
    from data.sources import load_synthetic

    data = torch.load(checkpoint, map_location="cpu", weights_only=True)["config"]["data"]
    return load_synthetic(["test"], seed=data["seed"], sizes=data["synthetic_sizes"])["test"]["tgt"][:]


def _csv_column(run: Path, name: str) -> list[float]:
    """Every value of `name` in the run's CSV log, in order."""
    with (run / "csv" / "metrics.csv").open(newline="") as handle:
        return [float(row[name]) for row in csv.DictReader(handle) if row.get(name)]


def _macro_f1(gold: list[str], predicted: list[str]) -> float:
    scores = []
    for label in sorted(set(gold) | set(predicted)):
        tp = sum(g == p == label for g, p in zip(gold, predicted))
        fp, fn = predicted.count(label) - tp, gold.count(label) - tp
        scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


# --- scores -------------------------------------------------------------------------------------------


def test_scores_equal_the_training_runs_test_step(translation_run: Path, tmp_path: Path) -> None:
    before = snapshot(translation_run)
    out = tmp_path / "eval"
    result = run_in_project(
        "evaluate.py", [f"ckpt_path={best_checkpoint(translation_run)}", f"hydra.run.dir={out}"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"output directory: {out}" in result.stdout
    trained, evaluated = read_metrics(translation_run), read_metrics(out)
    for name in EXACT:
        assert evaluated[name] == pytest.approx(trained[name], abs=1e-4), name  # trainer logs float32
    for name in CLOSE:
        assert evaluated[name] == pytest.approx(trained[name], rel=1e-5), name
    assert evaluated["test/chrf"] > 0
    # ...and equal what sacreBLEU gives for the written hypotheses against the split drawn again
    hypotheses = (out / "hypotheses.txt").read_text().splitlines()
    references = _synthetic_references(best_checkpoint(translation_run))
    assert len(hypotheses) == len(references) == 40
    assert evaluated["test/bleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    assert evaluated["test/chrf"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score)
    exact = sum(h.strip() == r.strip() for h, r in zip(hypotheses, references))
    assert evaluated["test/exact_match"] == pytest.approx(100.0 * exact / 40)
    assert evaluated["decoding"] == {
        "search": "auto",
        "beam_size": 1,
        "length_penalty": 0.6,
        "length_normalization": "gnmt",
        "max_len_a": 1.0,
        "max_len_b": 2,
        "n_best": 1,
        "top_k": 0,
        "top_p": 1.0,
        "temperature": 1.0,
        "min_len": 0,
        "no_repeat_ngram_size": 0,
        "kv_cache": "auto",
        "alignments": False,
        "alignment_layer": -2,
    }
    assert evaluated["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert evaluated["split"] == "test" and evaluated["num_examples"] == 40
    assert len((out / "hypotheses.txt").read_text().splitlines()) == 40
    with (out / "predictions.tsv").open(newline="") as handle:
        assert len(list(csv.reader(handle, delimiter="\t"))) == 41
    text = assert_valid_markdown(out / "report.md")
    for picture in ("bleu_by_length.png", "learning_curves.png"):
        assert f"]({picture})" in text
        assert_png(out / picture)
    assert len(list((out / "attention").glob("*cross*.png"))) == 2
    assert snapshot(translation_run) == before  # nothing in the training run was touched


def test_classification_scores_equal_the_training_runs_test_step(
    classification_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "eval"
    result = run_in_project(
        "evaluate.py", [f"ckpt_path={best_checkpoint(classification_run)}", f"hydra.run.dir={out}"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trained, evaluated = read_metrics(classification_run), read_metrics(out)
    for name in ("test/acc", "test/f1", "test/loss"):  # both score the EMA weights validation chose
        assert evaluated[name] == pytest.approx(trained[name], rel=1e-5), name
    checkpoint = torch.load(best_checkpoint(classification_run), weights_only=True)
    raw = checkpoint["current_model_state"]
    assert any(not torch.equal(checkpoint["state_dict"][key], value) for key, value in raw.items())
    assert evaluated["split"] == "dev" and evaluated["task"] == "classification"
    assert 0.0 <= evaluated["test/ece"] <= 1.0  # its value: tests/unit/test_evaluation.py
    assert sum(map(sum, evaluated["confusion_matrix"]["rows_gold_columns_predicted"])) == 30
    with (out / "predictions.tsv").open(newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    gold, predicted = [r["label"] for r in rows], [r["prediction"] for r in rows]
    with (classification_run.parent / "data" / "dev.tsv").open(newline="") as handle:
        dev = list(csv.DictReader(handle, delimiter="\t"))  # the gold labels as written, 0 / 1
    assert len(rows) == 30 and gold == [("negative", "positive")[int(r["label"])] for r in dev]
    assert evaluated["test/acc"] == pytest.approx(sum(g == p for g, p in zip(gold, predicted)) / 30)
    assert evaluated["test/f1"] == pytest.approx(_macro_f1(gold, predicted), rel=1e-6)
    assert_valid_markdown(out / "report.md")
    assert_png(out / "confusion_matrix.png")


def test_wandb_logger_gets_metrics_and_report_images(
    classification_run: Path, tmp_path: Path, compose_eval, monkeypatch: pytest.MonkeyPatch
) -> None:
    from evaluate import evaluate

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ckpt = f"ckpt_path={best_checkpoint(classification_run)}"
    evaluate(compose_eval(tmp_path / "plain", ckpt, "report.enabled=false"))  # loggers get metrics anyway
    assert not (tmp_path / "plain" / "wandb").exists()  # no logger unless asked for
    metrics = evaluate(compose_eval(tmp_path / "wandb", ckpt, "logger=wandb"))
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    images = list((runs[0] / "files" / "media" / "images").rglob("*.png"))
    assert any("confusion_matrix" in p.name for p in images), images
    assert metrics["test/acc"] == read_metrics(tmp_path / "plain")["test/acc"]


def test_any_split_of_local_multi30k_files(
    translation_run: Path, multi30k_dir: Path, tmp_path: Path, compose_eval
):
    """The quickstart model is English -> German like Multi30k: point its datamodule at the official
    data/task1/raw files and score a split by name (the checkpoint's tokenizer is used as it is)."""
    from evaluate import evaluate

    overrides = [
        f"ckpt_path={best_checkpoint(translation_run)}",
        "+data.source=multi30k",
        f"data.data_dir={multi30k_dir}",
    ]
    evaluate(
        compose_eval(
            tmp_path / "flickr", *overrides, "data.test_split=test_2016_flickr", "report.enabled=false"
        )
    )
    metrics = read_metrics(tmp_path / "flickr")
    assert metrics["split"] == "test_2016_flickr" and metrics["num_examples"] == 1000
    assert metrics["data_source"] == "multi30k" and metrics["data_dir"] == str(multi30k_dir)
    assert len((tmp_path / "flickr" / "hypotheses.txt").read_text().splitlines()) == 1000


def test_beam_one_equals_greedy(translation_run: Path, tmp_path: Path, compose_eval) -> None:
    from evaluate import evaluate

    ckpt = f"ckpt_path={best_checkpoint(translation_run)}"
    greedy = evaluate(compose_eval(tmp_path / "greedy", ckpt, "decode=greedy", "report.enabled=false"))
    beam = evaluate(
        compose_eval(
            tmp_path / "beam", ckpt, "decode.search=beam", "decode.beam_size=1", "report.enabled=false"
        )
    )
    assert beam == greedy
    assert (tmp_path / "beam" / "hypotheses.txt").read_text() == (
        tmp_path / "greedy" / "hypotheses.txt"
    ).read_text()
    assert read_metrics(tmp_path / "beam")["decoding"]["search"] == "beam"


def test_a_quick_subset_scores_the_splits_first_sentences(
    translation_run: Path, tmp_path: Path, compose_eval
) -> None:
    """`data.test_sentences=N` scores the first N sentences of the split, as the whole split's run
    decodes them (issue 51: evaluate.py had no quick subset)."""
    from evaluate import evaluate

    ckpt = f"ckpt_path={best_checkpoint(translation_run)}"
    evaluate(compose_eval(tmp_path / "all", ckpt, "report.enabled=false"))
    evaluate(compose_eval(tmp_path / "five", ckpt, "report.enabled=false", "data.test_sentences=5"))
    assert read_metrics(tmp_path / "five")["num_examples"] == 5
    five = (tmp_path / "five" / "hypotheses.txt").read_text().splitlines()
    assert five == (tmp_path / "all" / "hypotheses.txt").read_text().splitlines()[:5]
    references = _synthetic_references(best_checkpoint(translation_run))[:5]
    bleu = read_metrics(tmp_path / "five")["test/bleu"]
    assert bleu == pytest.approx(sacrebleu.corpus_bleu(five, [references]).score)


def test_decoding_sweep(translation_run: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = run_in_project(
        "evaluate.py",
        [
            "-m",
            f"ckpt_path={best_checkpoint(translation_run)}",
            f"hydra.sweep.dir={sweep}",
            "report.enabled=false",
            "progress=false",
            "decode.beam_size=1,4",
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = [read_metrics(sweep / str(n)) for n in (0, 1)]
    assert [job["decoding"]["beam_size"] for job in jobs] == [1, 4]
    assert jobs[0]["test/bleu"] == pytest.approx(read_metrics(translation_run)["test/bleu"], abs=1e-4)
    assert all(len((sweep / str(n) / "hypotheses.txt").read_text().splitlines()) == 40 for n in (0, 1))


@pytest.mark.gpu
def test_gpu_checkpoint_evaluates_on_cpu(translation_run: Path, tmp_path: Path, compose_eval) -> None:
    from evaluate import evaluate

    best = best_checkpoint(translation_run)
    checkpoint = torch.load(best, map_location="cuda", weights_only=True)
    assert next(iter(checkpoint["state_dict"].values())).is_cuda
    gpu_ckpt = tmp_path / "gpu.ckpt"
    torch.save(checkpoint, gpu_ckpt)
    on_cpu = evaluate(compose_eval(tmp_path / "cpu", f"ckpt_path={gpu_ckpt}", "report.enabled=false"))
    assert on_cpu["test/bleu"] == pytest.approx(read_metrics(translation_run)["test/bleu"], abs=1e-4)
    on_gpu = evaluate(
        compose_eval(tmp_path / "gpu", f"ckpt_path={best}", "device=cuda", "report.enabled=false")
    )
    assert on_gpu["test/loss"] == pytest.approx(on_cpu["test/loss"], rel=1e-3)


@pytest.mark.gpu
def test_gpu_bf16_training_run_then_cpu_evaluation(tmp_path: Path, compose_eval) -> None:
    """`trainer=gpu` (bf16-mixed autocast, gradient clipping on) through the CLI, then evaluate.py on the
    CPU in fp32: the same accuracy up to the odd example whose logits bf16 rounds the other way."""
    from evaluate import evaluate

    data = write_sst(tmp_path / "data")
    run = train_run(
        tmp_path / "run",
        tmp_path / "cache",
        [
            "data=sst2",
            "model=classification",
            f"data.data_dir={data}",
            *TINY_SST,
            "callbacks.model_checkpoint.monitor=val/acc",
            "optimized_metric=val/acc_best",
        ],
        trainer="gpu",
    )
    trained = read_metrics(run)
    assert trained["global_step"] > 0 and "test/acc" in trained
    on_cpu = evaluate(
        compose_eval(tmp_path / "eval", f"ckpt_path={best_checkpoint(run)}", "report.enabled=false")
    )
    assert on_cpu["test/acc"] == pytest.approx(trained["test/acc"], abs=2 / 30)  # 30 dev rows
    assert on_cpu["test/loss"] == pytest.approx(trained["test/loss"], rel=0.05)
