"""evaluate.py on bad input (a missing, truncated or malicious checkpoint, the other task's checkpoint, an
unknown or unlabeled split, ...): one `error:` line on stderr, exit status 1, no traceback."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import trained
from tests.helpers.cli import run_script
from tests.helpers.driver import run_in_one_interpreter
from tests.helpers.evaluate_runs import best_checkpoint, run_in_project
from tests.helpers.refusals import MaliciousPickle
from tests.helpers.repo import REPO_ROOT, cli_env

# in-process evaluations of tiny models: one thread is several times faster on a busy 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

# the session's tiny runs (tests/helpers/trained.py), shared with other modules of this test process
translation_run, classification_run = trained.translation_run, trained.classification_run


# --- bad input: one line on stderr, exit status 1 ----------------------------------------------------------


def _error_cases(root: Path, translation: Path, classification: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (evaluate.py arguments, text the error line must contain)."""
    best, cls_best = best_checkpoint(translation), best_checkpoint(classification)
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
    results.update({name: run_in_project("evaluate.py", args[name]) for name in EVALUATE_PROCESSES[1:]})
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
