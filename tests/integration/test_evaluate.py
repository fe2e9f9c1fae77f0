"""evaluate.py end to end on checkpoints of real (tiny) training runs made with train.py.

Scores equal the training run's own test step; beam 1 equals greedy; decoding sweeps, stdin
translation and checkpoint averaging work through the real command line; bad input (missing,
truncated or malicious checkpoint, the other task's checkpoint, unknown or unlabeled split) stops
with one `error:` line and exit status 1.
"""

from __future__ import annotations

import csv
import json
import os
import pickle
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import sacrebleu
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from tests.helpers import trained
from tests.helpers.cli import run_script
from tests.helpers.driver import run_in_one_interpreter
from tests.helpers.refusals import MaliciousPickle, snapshot
from tests.helpers.repo import REPO_ROOT, cli_env
from tests.helpers.reports import assert_png, assert_valid_markdown
from tests.helpers.sst import TINY_SST, write_sst
from tests.helpers.trained import train_run

# in-process evaluations of tiny models: one thread is several times faster on a busy 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

# the session's tiny runs (tests/helpers/trained.py), shared with other modules of this test process
translation_run, classification_run = trained.translation_run, trained.classification_run

EXACT = ("test/bleu", "test/chrf", "test/exact_match")
CLOSE = ("test/loss", "test/nll", "test/ppl", "test/token_acc")


def _run(script: str, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PROJECT_ROOT": str(REPO_ROOT), "WANDB_MODE": "offline"}
    return run_script(script, args, stdin=stdin, env=env)


def test_pretrain_then_fine_tune(tmp_path: Path) -> None:
    """experiment=sst2_pretrain, then experiment=sst2 model.init_from=<its checkpoint>; a pretraining
    checkpoint is refused by evaluate.py, and one of another tokenizer by init_from, before any file."""
    data, cache = write_sst(tmp_path / "data"), tmp_path / "cache"
    tiny = [f"data.data_dir={data}", *TINY_SST, "data.max_len=16", "model.config.max_len=16"]
    pre = train_run(tmp_path / "pre", cache, ["experiment=sst2_pretrain", *tiny])
    pre_metrics = _metrics(pre)
    assert pre_metrics["val/loss_best"] == pytest.approx(min(_csv_column(pre, "val/loss")))
    assert "test/loss" in pre_metrics
    ckpt = pre / "checkpoints" / "last.ckpt"
    fine = _run(
        "train.py",
        [f"hydra.run.dir={tmp_path / 'fine'}", f"paths.cache_dir={cache}", "logger=csv", "experiment=sst2",
         *tiny, f"model.init_from={ckpt}"],
    )  # fmt: skip
    assert fine.returncode == 0, fine.stderr[-3000:]
    log_text = (tmp_path / "fine" / "train.log").read_text()
    # the embedding and one post-LN layer (attention 4, feed-forward 4, norms 4); no final norm after post-LN
    assert f"Initialized 13 encoder tensors from {ckpt}" in log_text
    assert "test/acc" in _metrics(tmp_path / "fine")
    evaluated = _run("evaluate.py", [f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'eval'}"])
    assert evaluated.returncode == 1
    assert "masked-LM pretraining checkpoint" in evaluated.stderr.splitlines()[-1]
    other = _run(
        "train.py",
        [f"hydra.run.dir={tmp_path / 'other'}", f"paths.cache_dir={cache}", "logger=csv", "experiment=sst2",
         *tiny, "data.vocab_size=90", f"model.init_from={ckpt}"],
    )  # fmt: skip
    assert other.returncode == 1
    assert other.stderr.rstrip().splitlines()[-1].startswith(f"error: model.init_from={ckpt} was pretrained")
    assert not any((tmp_path / "other" / name).exists() for name in ("checkpoints", "config.yaml"))


def _metrics(directory: Path) -> dict:
    return json.loads((directory / "metrics.json").read_text())


def _best(run: Path) -> Path:
    return Path(_metrics(run)["best_ckpt_path"])


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


@pytest.fixture
def compose_eval(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """`evaluate(cfg)` in this process (no interpreter start-up): compose configs/eval.yaml with overrides."""
    monkeypatch.setenv("PROJECT_ROOT", str(REPO_ROOT))

    def make(out_dir: Path, *overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
            return compose("eval", overrides=[f"paths.output_dir={out_dir}", "progress=false", *overrides])

    yield make


# --- scores -------------------------------------------------------------------------------------------


def test_scores_equal_the_training_runs_test_step(translation_run: Path, tmp_path: Path) -> None:
    before = snapshot(translation_run)
    out = tmp_path / "eval"
    result = _run("evaluate.py", [f"ckpt_path={_best(translation_run)}", f"hydra.run.dir={out}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"output directory: {out}" in result.stdout
    trained, evaluated = _metrics(translation_run), _metrics(out)
    for name in EXACT:
        assert evaluated[name] == pytest.approx(trained[name], abs=1e-4), name  # trainer logs float32
    for name in CLOSE:
        assert evaluated[name] == pytest.approx(trained[name], rel=1e-5), name
    assert evaluated["test/chrf"] > 0
    # ...and equal what sacreBLEU gives for the written hypotheses against the split drawn again
    hypotheses = (out / "hypotheses.txt").read_text().splitlines()
    references = _synthetic_references(_best(translation_run))
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
    result = _run("evaluate.py", [f"ckpt_path={_best(classification_run)}", f"hydra.run.dir={out}"])
    assert result.returncode == 0, result.stderr[-3000:]
    trained, evaluated = _metrics(classification_run), _metrics(out)
    for name in ("test/acc", "test/f1", "test/loss"):  # both score the EMA weights validation chose
        assert evaluated[name] == pytest.approx(trained[name], rel=1e-5), name
    checkpoint = torch.load(_best(classification_run), weights_only=True)
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
    ckpt = f"ckpt_path={_best(classification_run)}"
    evaluate(compose_eval(tmp_path / "plain", ckpt, "report.enabled=false"))  # loggers get metrics anyway
    assert not (tmp_path / "plain" / "wandb").exists()  # no logger unless asked for
    metrics = evaluate(compose_eval(tmp_path / "wandb", ckpt, "logger=wandb"))
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    images = list((runs[0] / "files" / "media" / "images").rglob("*.png"))
    assert any("confusion_matrix" in p.name for p in images), images
    assert metrics["test/acc"] == _metrics(tmp_path / "plain")["test/acc"]


def test_any_split_of_local_multi30k_files(
    translation_run: Path, multi30k_dir: Path, tmp_path: Path, compose_eval
):
    """The quickstart model is English -> German like Multi30k: point its datamodule at the official
    data/task1/raw files and score a split by name (the checkpoint's tokenizer is used as it is)."""
    from evaluate import evaluate

    overrides = [
        f"ckpt_path={_best(translation_run)}",
        "+data.source=multi30k",
        f"data.data_dir={multi30k_dir}",
    ]
    evaluate(
        compose_eval(
            tmp_path / "flickr", *overrides, "data.test_split=test_2016_flickr", "report.enabled=false"
        )
    )
    metrics = _metrics(tmp_path / "flickr")
    assert metrics["split"] == "test_2016_flickr" and metrics["num_examples"] == 1000
    assert metrics["data_source"] == "multi30k" and metrics["data_dir"] == str(multi30k_dir)
    assert len((tmp_path / "flickr" / "hypotheses.txt").read_text().splitlines()) == 1000


def test_beam_one_equals_greedy(translation_run: Path, tmp_path: Path, compose_eval) -> None:
    from evaluate import evaluate

    ckpt = f"ckpt_path={_best(translation_run)}"
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
    assert _metrics(tmp_path / "beam")["decoding"]["search"] == "beam"


def test_a_quick_subset_scores_the_splits_first_sentences(
    translation_run: Path, tmp_path: Path, compose_eval
) -> None:
    """`data.test_sentences=N` scores the first N sentences of the split, as the whole split's run
    decodes them (issue 51: evaluate.py had no quick subset)."""
    from evaluate import evaluate

    ckpt = f"ckpt_path={_best(translation_run)}"
    evaluate(compose_eval(tmp_path / "all", ckpt, "report.enabled=false"))
    evaluate(compose_eval(tmp_path / "five", ckpt, "report.enabled=false", "data.test_sentences=5"))
    assert _metrics(tmp_path / "five")["num_examples"] == 5
    five = (tmp_path / "five" / "hypotheses.txt").read_text().splitlines()
    assert five == (tmp_path / "all" / "hypotheses.txt").read_text().splitlines()[:5]
    references = _synthetic_references(_best(translation_run))[:5]
    bleu = _metrics(tmp_path / "five")["test/bleu"]
    assert bleu == pytest.approx(sacrebleu.corpus_bleu(five, [references]).score)


def test_decoding_sweep(translation_run: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = _run(
        "evaluate.py",
        [
            "-m",
            f"ckpt_path={_best(translation_run)}",
            f"hydra.sweep.dir={sweep}",
            "report.enabled=false",
            "progress=false",
            "decode.beam_size=1,4",
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = [_metrics(sweep / str(n)) for n in (0, 1)]
    assert [job["decoding"]["beam_size"] for job in jobs] == [1, 4]
    assert jobs[0]["test/bleu"] == pytest.approx(_metrics(translation_run)["test/bleu"], abs=1e-4)
    assert all(len((sweep / str(n) / "hypotheses.txt").read_text().splitlines()) == 40 for n in (0, 1))


# --- translating text -----------------------------------------------------------------------------------


def test_translate_stdin_to_stdout(translation_run: Path, tmp_path: Path, compose_eval, capsys) -> None:
    from evaluate import evaluate

    ckpt = f"ckpt_path={_best(translation_run)}"
    evaluate(compose_eval(tmp_path / "eval", ckpt, "report.enabled=false"))
    with (tmp_path / "eval" / "predictions.tsv").open(newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    capsys.readouterr()
    lines = [rows[0]["source"], "", rows[1]["source"], rows[2]["source"]]
    result = _run(
        "evaluate.py", [ckpt, f"hydra.run.dir={tmp_path / 'pipe'}", "translate.input=-"], "\n".join(lines)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # stdout holds the translations and nothing else: one line per input line, empty stays empty
    assert result.stdout.split("\n") == [
        rows[0]["hypothesis"],
        "",
        rows[1]["hypothesis"],
        rows[2]["hypothesis"],
        "",
    ]
    assert "[evaluate]" not in result.stdout and "Tokenizing" not in result.stdout
    # a file in, a file out (in-process), in chunks of two lines
    source, target = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(row["source"] for row in rows[:5]) + "\n")
    assert (
        evaluate(
            compose_eval(
                tmp_path / "file",
                ckpt,
                f"translate.input={source}",
                f"translate.output={target}",
                "translate.chunk_lines=2",
            )
        )
        == {}
    )
    assert target.read_text().splitlines() == [row["hypothesis"] for row in rows[:5]]
    assert capsys.readouterr().out == ""


# --- checkpoint averaging --------------------------------------------------------------------------------


def test_average_last(translation_run: Path, tmp_path: Path, compose_eval) -> None:
    """average_last=3 scores the elementwise mean of the run's last three (different) checkpoints."""
    from evaluate import evaluate
    from transformer.checkpoint import average_checkpoints
    from transformer.evaluation.restore import last_checkpoints

    checkpoints = translation_run / "checkpoints"
    epochs = [checkpoints / f"epoch_{e:03d}.ckpt" for e in range(3)]
    # last.ckpt is a copy of the newest epoch's file (same step): counted once, as that epoch
    assert last_checkpoints(translation_run, 3) == epochs
    states = [torch.load(p, map_location="cpu", weights_only=True)["state_dict"] for p in epochs]
    floats = [key for key, value in states[0].items() if value.is_floating_point()]
    assert len(floats) > 10
    mean = {key: torch.stack([s[key].double() for s in states]).mean(0).float() for key in floats}
    averaged = average_checkpoints(epochs)["state_dict"]
    assert averaged.keys() == states[0].keys()
    for key in floats:
        torch.testing.assert_close(averaged[key], mean[key], rtol=1e-6, atol=1e-7)
    # not an identity: training moved the weights between the epochs, the mean is none of them
    assert sum(not torch.equal(mean[key], s[key]) for key in floats for s in states) > 3 * len(floats) // 2
    # The mean by hand, in a checkpoint of its own: evaluate.py on it == evaluate.py average_last=3.
    by_hand = tmp_path / "mean.ckpt"
    last = torch.load(epochs[-1], map_location="cpu", weights_only=True)
    torch.save({**last, "state_dict": {**last["state_dict"], **mean}}, by_hand)
    expected = evaluate(compose_eval(tmp_path / "by_hand", f"ckpt_path={by_hand}", "report.enabled=false"))
    out = tmp_path / "averaged"
    result = _run(
        "evaluate.py",
        [f"ckpt_path={translation_run}", "average_last=3", f"hydra.run.dir={out}", "report.enabled=false"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = _metrics(out)
    assert metrics["averaged_from"] == [str(p) for p in epochs]
    for name in EXACT:
        assert metrics[name] == expected[name], name
    for name in CLOSE:
        assert metrics[name] == pytest.approx(expected[name], rel=1e-5), name
    assert (out / "hypotheses.txt").read_text() == (tmp_path / "by_hand" / "hypotheses.txt").read_text()
    # ...and not the scores of the checkpoint the run's own test step used (one of the three)
    assert metrics["test/loss"] != pytest.approx(_metrics(translation_run)["test/loss"], rel=1e-4)


# --- ensembles, n-best lists, sampling ---------------------------------------------------------------------


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_ensembles_of_checkpoints(translation_run: Path, tmp_path: Path, compose_eval) -> None:
    """ckpt_path=[a,b]: a self-ensemble decodes like its model; weight 0 silences a model; two different
    epochs give an ensemble of their own, recorded in metrics.json."""
    from evaluate import evaluate

    first, best = (translation_run / "checkpoints" / f"epoch_{e:03d}.ckpt" for e in (0, 2))  # differ
    quiet = ("report.enabled=false", "decode.beam_size=3")
    alone = evaluate(compose_eval(tmp_path / "alone", f"ckpt_path={best}", *quiet))
    twice = evaluate(compose_eval(tmp_path / "twice", f"ckpt_path=[{best},{best}]", *quiet))
    silenced = evaluate(
        compose_eval(tmp_path / "silenced", f"ckpt_path=[{first},{best}]", "ensemble_weights=[0,1]", *quiet)
    )
    both = evaluate(compose_eval(tmp_path / "both", f"ckpt_path=[{first},{best}]", *quiet))
    reference = _lines(tmp_path / "alone" / "hypotheses.txt")
    assert _lines(tmp_path / "twice" / "hypotheses.txt") == reference
    assert _lines(tmp_path / "silenced" / "hypotheses.txt") == reference
    for name in EXACT:
        assert twice[name] == alone[name] == silenced[name], name
    for name in CLOSE:  # teacher forcing through the ensemble: the log of the mean probability
        assert twice[name] == pytest.approx(alone[name], rel=1e-5), name
    info = _metrics(tmp_path / "both")
    assert info["ensemble"] == [str(first.resolve()), str(best.resolve())]
    assert both["test/loss"] != pytest.approx(alone["test/loss"], rel=1e-4)  # a different model


def test_n_best_lists_and_sampling(translation_run: Path, tmp_path: Path, compose_eval, capsys) -> None:
    """decode.n_best=3 writes nbest.txt (id ||| hypothesis ||| score, best first; BLEU on the first);
    decode=sample is fixed by the seed; translate.input with n_best > 1 writes the same format."""
    from evaluate import evaluate

    ckpt = f"ckpt_path={_best(translation_run)}"
    one = evaluate(compose_eval(tmp_path / "one", ckpt, "report.enabled=false", "decode.beam_size=4"))
    three = evaluate(
        compose_eval(
            tmp_path / "three", ckpt, "report.enabled=false", "decode.beam_size=4", "decode.n_best=3"
        )
    )
    assert three["test/bleu"] == one["test/bleu"]
    assert not (tmp_path / "one" / "nbest.txt").exists()
    entries = [line.split(" ||| ") for line in _lines(tmp_path / "three" / "nbest.txt")]
    assert all(len(entry) == 3 for entry in entries)
    ids = [int(entry[0]) for entry in entries]
    assert ids == sorted(ids) and set(ids) == set(range(40))
    hypotheses = _lines(tmp_path / "one" / "hypotheses.txt")
    for index in range(40):
        mine = [entry for entry in entries if int(entry[0]) == index]
        assert 1 <= len(mine) <= 3 and mine[0][1] == " ".join(hypotheses[index].split())
        scores = [float(entry[2]) for entry in mine]
        assert scores == sorted(scores, reverse=True)

    def sampled(name: str, *overrides: str) -> list[str]:
        evaluate(compose_eval(tmp_path / name, ckpt, "report.enabled=false", "decode=sample", *overrides))
        return _lines(tmp_path / name / "hypotheses.txt")

    hot = ("decode.temperature=3.0", "decode.top_k=0")  # flat enough that the draws differ
    seed_0 = sampled("s0", *hot)
    assert seed_0 == sampled("s0_again", *hot)
    assert seed_0 != sampled("s1", *hot, "seed=1")
    evaluate(compose_eval(tmp_path / "greedy", ckpt, "report.enabled=false", "decode=greedy"))
    assert sampled("top_1", "decode.top_k=1") == _lines(tmp_path / "greedy" / "hypotheses.txt")
    source = tmp_path / "in.txt"
    with (tmp_path / "one" / "predictions.tsv").open(newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    source.write_text(f"{rows[0]['source']}\n\n{rows[1]['source']}\n", encoding="utf-8")
    target = tmp_path / "out.txt"
    overrides = (
        "decode.beam_size=4",
        "decode.n_best=2",
        f"translate.input={source}",
        f"translate.output={target}",
    )
    assert evaluate(compose_eval(tmp_path / "pipe", ckpt, *overrides)) == {}
    lines = [line.split(" ||| ") for line in _lines(target)]
    assert {int(entry[0]) for entry in lines} == {0, 2}  # the blank line 1 gets no hypotheses
    assert next(entry[1] for entry in lines if entry[0] == "0") == " ".join(rows[0]["hypothesis"].split())
    assert capsys.readouterr().out == ""


@pytest.mark.gpu
def test_gpu_checkpoint_evaluates_on_cpu(translation_run: Path, tmp_path: Path, compose_eval) -> None:
    from evaluate import evaluate

    best = _best(translation_run)
    checkpoint = torch.load(best, map_location="cuda", weights_only=True)
    assert next(iter(checkpoint["state_dict"].values())).is_cuda
    gpu_ckpt = tmp_path / "gpu.ckpt"
    torch.save(checkpoint, gpu_ckpt)
    on_cpu = evaluate(compose_eval(tmp_path / "cpu", f"ckpt_path={gpu_ckpt}", "report.enabled=false"))
    assert on_cpu["test/bleu"] == pytest.approx(_metrics(translation_run)["test/bleu"], abs=1e-4)
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
    trained = _metrics(run)
    assert trained["global_step"] > 0 and "test/acc" in trained
    on_cpu = evaluate(compose_eval(tmp_path / "eval", f"ckpt_path={_best(run)}", "report.enabled=false"))
    assert on_cpu["test/acc"] == pytest.approx(trained["test/acc"], abs=2 / 30)  # 30 dev rows
    assert on_cpu["test/loss"] == pytest.approx(trained["test/loss"], rel=0.05)


# --- bad input: one line on stderr, exit status 1 ----------------------------------------------------------


def _error_cases(root: Path, translation: Path, classification: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (evaluate.py arguments, text the error line must contain)."""
    best, cls_best = _best(translation), _best(classification)
    truncated = root / "truncated.ckpt"
    data = best.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    evil = root / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": MaliciousPickle(root / "pwned")}, evil)
    raw_evil = root / "evil_raw.ckpt"
    raw_evil.write_bytes(pickle.dumps({"state_dict": {}, "payload": MaliciousPickle(root / "pwned")}))
    # translation weights and hyperparameters under a classification run's config
    mixed = root / "mixed.ckpt"
    t, c = (torch.load(p, map_location="cpu", weights_only=True) for p in (best, cls_best))
    torch.save({**t, "config": c["config"]}, mixed)
    # the same model with another tokenizer: an ensemble would average over two vocabularies
    other_tokenizer = root / "other_tokenizer.ckpt"
    state = dict(t["TranslationDataModule"])
    state["tokenizers"] = json.loads(json.dumps(state["tokenizers"]).replace("<unk>", "<UNK>"))
    torch.save({**t, "TranslationDataModule": state}, other_tokenizer)
    return {
        "missing": ([f"ckpt_path={root / 'nope.ckpt'}"], "does not exist"),
        "directory": ([f"ckpt_path={translation}"], "is a directory"),
        "truncated": ([f"ckpt_path={truncated}"], "truncated or corrupt"),
        "malicious": ([f"ckpt_path={evil}"], "refusing to load"),
        "malicious_raw_pickle": ([f"ckpt_path={raw_evil}"], str(raw_evil)),
        "decoding_options_on_classification": (
            [f"ckpt_path={cls_best}", "decode.beam_size=4"],
            "decode.beam_size: decoding options need a translation checkpoint",
        ),
        "translate_with_classification": (
            [f"ckpt_path={cls_best}", "translate.input=-"],
            "translate.input needs a translation checkpoint",
        ),
        "expected_other_task": (
            [f"ckpt_path={cls_best}", "task=translation"],
            "is a classification checkpoint",
        ),
        "config_state_mismatch": ([f"ckpt_path={mixed}"], "is inconsistent"),
        "unknown_split": (
            [f"ckpt_path={best}", "data.test_split=test_2099"],
            "splits ['test', 'train', 'val']",
        ),
        "unlabeled_split": ([f"ckpt_path={cls_best}", "data.test_split=test"], "split 'test' is unlabeled"),
        "empty_ensemble": (["ckpt_path=[]"], "ckpt_path=[] names no checkpoint"),
        "ensemble_member_missing": ([f"ckpt_path=[{best},{root / 'gone.ckpt'}]"], f"{root / 'gone.ckpt'}"),
        "ensemble_of_other_tokenizers": (
            [f"ckpt_path=[{best},{other_tokenizer}]"],
            f"{other_tokenizer} and {best} have different tokenizers",
        ),
        "ensemble_weights_length": (
            [f"ckpt_path=[{best},{best}]", "ensemble_weights=[1]"],
            "ensemble_weights has 1 values for 2 models",
        ),
        "bad_top_p": (
            [f"ckpt_path={best}", "decode=sample", "decode.top_p=1.5"],
            "decode.top_p must be in (0, 1]",
        ),
    }


@pytest.fixture(scope="module")
def error_runs(
    translation_run: Path, classification_run: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[subprocess.CompletedProcess[str], str, Path]]:
    """All bad-input runs in one interpreter (tests/helpers/driver.py); EVALUATE_PROCESSES as processes of
    their own: "missing" started as a user starts it (a fresh interpreter: what its imports print counts too),
    the other forked from the warm fork server (`run_script`)."""
    root = tmp_path_factory.mktemp("errors")
    cases = _error_cases(root, translation_run, classification_run)
    args = {name: [*arguments, f"hydra.run.dir={root / name}"] for name, (arguments, _) in cases.items()}
    in_one = [name for name in cases if name not in EVALUATE_PROCESSES]
    steps = [{"script": "evaluate.py", "args": args[name]} for name in in_one]
    env = {**os.environ, "PROJECT_ROOT": str(REPO_ROOT), "WANDB_MODE": "offline"}
    results = dict(zip(in_one, run_in_one_interpreter(steps, env=env), strict=True))
    results.update({name: _run("evaluate.py", args[name]) for name in EVALUATE_PROCESSES[1:]})
    first = EVALUATE_PROCESSES[0]
    results[first] = run_script("evaluate.py", args[first], env=cli_env(WANDB_MODE="offline"), fresh=True)
    return {name: (results[name], expected, root) for name, (_, expected) in cases.items()}


# the exit status, stderr and "no traceback" of a real `python evaluate.py` (a pickle's payload never runs)
EVALUATE_PROCESSES = ("missing", "malicious_raw_pickle")  # the first a cold start


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "directory",
        "truncated",
        "malicious",
        "malicious_raw_pickle",
        "decoding_options_on_classification",
        "translate_with_classification",
        "expected_other_task",
        "config_state_mismatch",
        "unknown_split",
        "unlabeled_split",
        "empty_ensemble",
        "ensemble_member_missing",
        "ensemble_of_other_tokenizers",
        "ensemble_weights_length",
        "bad_top_p",
    ],
)
def test_bad_input_is_one_clear_line(error_runs, case: str) -> None:
    result, expected, root = error_runs[case]
    assert result.returncode == 1, (result.stdout, result.stderr[-2000:])
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr[-2000:]
    assert expected in errors[0], errors[0]
    assert not (root / "pwned").exists()  # the planted payload never ran
