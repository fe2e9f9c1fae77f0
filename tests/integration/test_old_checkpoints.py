"""Checkpoints written before the redesign of the layout (issue 24: the tasks moved from `transformer.tasks`
to `transformer.training`, evaluation to `transformer.evaluation`) still load, evaluate to the same numbers
and hypotheses, and continue training.

The old checkpoint is made here, by the code of the last commit before the redesign (`git archive`), so
the test needs the repository's history; a shallow clone without that commit skips it.
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import TINY, run_script
from tests.helpers.repo import REPO_ROOT

pytestmark = pytest.mark.slow

BEFORE_REDESIGN = "c70b1b4"  # main just before the layout moved (transformer/tasks.py and friends)


def _old_tree(destination: Path) -> Path:
    try:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", BEFORE_REDESIGN],
            cwd=REPO_ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"needs git and commit {BEFORE_REDESIGN} of the repository's history")
    destination.mkdir()
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)
    return destination


def _run(tree: Path, script: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    done = run_script(tree / script, args, cwd=tree)  # the old scripts find their own tree
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_checkpoint_from_before_the_redesign_evaluates_the_same_and_continues(tmp_path: Path) -> None:
    old = _old_tree(tmp_path / "old")
    run = tmp_path / "run"
    common = [*TINY, "logger=csv", f"paths.cache_dir={tmp_path / 'cache'}"]
    _run(old, "train.py", [*common, f"paths.output_dir={run}", f"hydra.run.dir={run}"])
    ckpt = run / "checkpoints" / "last.ckpt"
    assert "transformer.tasks.TranslationTask" in (run / "config.yaml").read_text()  # really the old layout

    scored = {}
    for name, tree in (("old", old), ("new", REPO_ROOT)):
        out = tmp_path / f"eval-{name}"
        _run(tree, "evaluate.py", [f"ckpt_path={ckpt}", f"hydra.run.dir={out}", "decode.beam_size=2"])
        scored[name] = (json.loads((out / "metrics.json").read_text()), (out / "hypotheses.txt").read_text())
    (old_metrics, old_hypotheses), (new_metrics, new_hypotheses) = scored["old"], scored["new"]
    assert new_hypotheses == old_hypotheses and old_hypotheses.strip()
    assert new_metrics["test/bleu"] == old_metrics["test/bleu"]
    for name, value in old_metrics.items():
        if isinstance(value, float):
            assert new_metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name

    # today's train.py resumes the old run (one more epoch) from its checkpoint
    more = tmp_path / "more"
    args = [
        *common,
        "trainer.max_epochs=3",
        f"ckpt_path={ckpt}",
        f"paths.output_dir={more}",
        f"hydra.run.dir={more}",
    ]
    _run(REPO_ROOT, "train.py", args)
    resumed = json.loads((more / "metrics.json").read_text())
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    old_steps = _train_steps(run / "csv" / "metrics.csv")  # epoch -> its logged training steps
    per_epoch = len(old_steps[0])
    assert saved["epoch"] == 1 and sorted(old_steps) == [0, 1] and len(old_steps[1]) == per_epoch > 0
    assert saved["global_step"] == 2 * per_epoch
    # exactly one more epoch, starting where the old run stopped (a run ignoring ckpt_path would log
    # steps from 0 and end at global_step per_epoch)
    assert resumed["epoch"] == 3 and resumed["global_step"] == saved["global_step"] + per_epoch
    new_steps = _train_steps(more / "csv" / "metrics.csv")
    assert sorted(new_steps) == [2]
    assert new_steps[2] == list(range(saved["global_step"], saved["global_step"] + per_epoch))


def _train_steps(metrics_csv: Path) -> dict[int, list[int]]:
    """epoch -> the steps at which the CSV log has a per-step training loss."""
    steps: dict[int, list[int]] = {}
    with metrics_csv.open() as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                steps.setdefault(int(row["epoch"]), []).append(int(row["step"]))
    return steps
