"""evaluate.py's translations on checkpoints of real (tiny) training runs: text from stdin to stdout,
checkpoint averaging (average_last), ensembles of checkpoints, n-best lists and sampling."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tests.helpers import evaluate_runs, trained
from tests.helpers.evaluate_runs import CLOSE, EXACT, best_checkpoint, read_metrics, run_in_project

# in-process evaluations of tiny models: one thread is several times faster on a busy 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

# the session's tiny runs (tests/helpers/trained.py), shared with other modules of this test process
translation_run = trained.translation_run
compose_eval = evaluate_runs.compose_eval


# --- translating text -----------------------------------------------------------------------------------


def test_translate_stdin_to_stdout(translation_run: Path, tmp_path: Path, compose_eval, capsys) -> None:
    from evaluate import evaluate

    ckpt = f"ckpt_path={best_checkpoint(translation_run)}"
    evaluate(compose_eval(tmp_path / "eval", ckpt, "report.enabled=false"))
    with (tmp_path / "eval" / "predictions.tsv").open(newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    capsys.readouterr()
    lines = [rows[0]["source"], "", rows[1]["source"], rows[2]["source"]]
    result = run_in_project(
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
    result = run_in_project(
        "evaluate.py",
        [f"ckpt_path={translation_run}", "average_last=3", f"hydra.run.dir={out}", "report.enabled=false"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert metrics["averaged_from"] == [str(p) for p in epochs]
    for name in EXACT:
        assert metrics[name] == expected[name], name
    for name in CLOSE:
        assert metrics[name] == pytest.approx(expected[name], rel=1e-5), name
    assert (out / "hypotheses.txt").read_text() == (tmp_path / "by_hand" / "hypotheses.txt").read_text()
    # ...and not the scores of the checkpoint the run's own test step used (one of the three)
    assert metrics["test/loss"] != pytest.approx(read_metrics(translation_run)["test/loss"], rel=1e-4)


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
    info = read_metrics(tmp_path / "both")
    assert info["ensemble"] == [str(first.resolve()), str(best.resolve())]
    assert both["test/loss"] != pytest.approx(alone["test/loss"], rel=1e-4)  # a different model


def test_n_best_lists_and_sampling(translation_run: Path, tmp_path: Path, compose_eval, capsys) -> None:
    """decode.n_best=3 writes nbest.txt (id ||| hypothesis ||| score, best first; BLEU on the first);
    decode=sample is fixed by the seed; translate.input with n_best > 1 writes the same format."""
    from evaluate import evaluate

    ckpt = f"ckpt_path={best_checkpoint(translation_run)}"
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
