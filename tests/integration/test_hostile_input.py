"""Reliability promises (docs/reliability.md), checked through the real command line where it matters: hostile
input (unknown keys, wrong values, bad or binary data, foreign, truncated or malicious checkpoints, a
read-only output directory) is refused in one `error:` line, non-zero exit, no traceback, nothing written
over."""

from __future__ import annotations

import ctypes
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.driver import run_in_one_interpreter
from tests.helpers.refusals import MaliciousPickle, snapshot
from tests.helpers.reliability import (
    error_line,
    load_checkpoint,
    train_args,
    train_in,
)
from tests.helpers.repo import REPO_ROOT, cli_env

# --- hostile input: one line, non-zero exit, nothing written over --------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    done = train_in(run_dir, ["trainer.max_steps=3"])
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def _hostile_cases(root: Path, run: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """name -> (train.py arguments, texts the one error line must contain: what is wrong, not only where)."""
    last = run / "checkpoints" / "last.ckpt"
    data = last.read_bytes()
    (root / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    torch.save({"state_dict": {}, "payload": MaliciousPickle(root / "pwned")}, root / "evil.ckpt")
    (root / "evil_raw.ckpt").write_bytes(
        pickle.dumps({"state_dict": {}, "x": MaliciousPickle(root / "pwned")})
    )
    classification = load_checkpoint(last)
    classification["config"]["model"]["_target_"] = "transformer.training.ClassificationTask"
    torch.save(classification, root / "classification.ckpt")
    multi30k = root / "multi30k"
    multi30k.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("de", "en"):
            (multi30k / f"{split}.{lang}").write_bytes(os.urandom(3000))  # binary given as text
    gz = root / "gz"
    gz.mkdir()
    import gzip

    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("de", "en"):
            blob = gzip.compress(b"a small sentence .\n" * 200)
            (gz / f"{split}.{lang}.gz").write_bytes(blob[: len(blob) // 2])  # truncated gzip
    (root / "a_file").write_text("not a directory\n")
    m30 = ["experiment=multi30k_de_en", "data.vocab_size=300"]
    return {
        "unknown_key": (["model.config.d_modle=64"], ("d_modle",)),
        "unknown_top_key": (["lrr=1"], ("lrr",)),
        "unknown_experiment": (["experiment=quickstrat"], ("quickstart",)),
        "wrong_type_lr": (["model.optimizer.lr=abc"], ("model.optimizer.lr",)),
        "wrong_type_epochs": (["trainer.max_epochs=abc"], ("trainer.max_epochs",)),
        "negative_lr": (["model.optimizer.lr=-1"], ("lr",)),
        "dropout_one": (["model.config.dropout=1.0"], ("dropout",)),
        "max_tokens_too_small": (["data.max_tokens=5"], ("max_tokens",)),
        "missing_data_dir": ([*m30, f"data.data_dir={root / 'nope'}"], (f"{root / 'nope'} does not exist",)),
        "binary_as_text": ([*m30, f"data.data_dir={multi30k}"], (str(multi30k), "invalid UTF-8")),
        "truncated_gzip": ([*m30, f"data.data_dir={gz}"], (f"cannot read {gz}", ".gz")),
        "truncated_checkpoint": (
            [f"ckpt_path={root / 'truncated.ckpt'}"],
            ("truncated.ckpt", "truncated or corrupt"),
        ),
        "malicious_checkpoint": ([f"ckpt_path={root / 'evil.ckpt'}"], ("evil.ckpt", "refusing to load")),
        "malicious_raw_pickle": (
            [f"ckpt_path={root / 'evil_raw.ckpt'}"],
            ("evil_raw.ckpt", "refusing to load"),
        ),
        "other_task_checkpoint": (
            [f"ckpt_path={root / 'classification.ckpt'}"],
            ("holds a classification model", "this run builds TranslationTask"),
        ),
        "other_model_checkpoint": (
            [f"ckpt_path={last}", "model.config.d_model=64"],
            ("does not fit", "d_model"),
        ),
        "output_dir_is_a_file": (
            [f"paths.output_dir={root / 'a_file' / 'run'}"],
            ("a_file", "is not writable"),
        ),
    }


@pytest.fixture(scope="module")
def hostile_runs(finished_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hostile")
    cases = _hostile_cases(root, finished_run)
    before = snapshot(finished_run)
    in_driver = [name for name in cases if name != HOSTILE_FORKED]
    steps = [
        {
            "script": "train.py",
            "args": train_args(root / name, cases[name][0]),
            "cwd": str(root),
            "subprocess": name == HOSTILE_FRESH,
        }
        for name in in_driver
    ]
    results = dict(zip(in_driver, run_in_one_interpreter(steps), strict=True))
    results[HOSTILE_FORKED] = train_in(root / HOSTILE_FORKED, cases[HOSTILE_FORKED][0])
    return {"root": root, "cases": cases, "results": results, "before": before, "run": finished_run}


# the cases run in one interpreter (tests/helpers/driver.py), but two as a process of their own, with the exit
# status, stderr and "no traceback" of a real `python train.py`: Hydra's errors in a fresh interpreter, as a
# user starts it (what its imports print counts too); the pickle's payload in a process forked from the
# warm one
HOSTILE_FRESH, HOSTILE_FORKED = "unknown_key", "malicious_raw_pickle"
HOSTILE = [
    "unknown_key",
    "unknown_top_key",
    "unknown_experiment",
    "wrong_type_lr",
    "wrong_type_epochs",
    "negative_lr",
    "dropout_one",
    "max_tokens_too_small",
    "missing_data_dir",
    "binary_as_text",
    "truncated_gzip",
    "truncated_checkpoint",
    "malicious_checkpoint",
    "malicious_raw_pickle",
    "other_task_checkpoint",
    "other_model_checkpoint",
    "output_dir_is_a_file",
]


@pytest.mark.slow
@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_input_is_one_line_nonzero_and_writes_nothing(
    hostile_runs: dict[str, Any], case: str
) -> None:
    result = hostile_runs["results"][case]
    expected = hostile_runs["cases"][case][1]
    assert result.returncode == 1, (result.stdout[-1000:], result.stderr[-3000:])
    line = error_line(result)
    assert line.startswith("error: ") and all(text in line for text in expected), (expected, line)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (hostile_runs["root"] / "pwned").exists()  # the planted payload never ran
    assert not list((hostile_runs["root"] / case).rglob("*.ckpt"))  # nothing trained, nothing saved
    assert snapshot(hostile_runs["run"]) == hostile_runs["before"]  # the finished run is untouched


@pytest.mark.slow
def test_unknown_experiment_lists_the_valid_ones(hostile_runs: dict[str, Any]) -> None:
    line = error_line(hostile_runs["results"]["unknown_experiment"])
    for path in (REPO_ROOT / "configs" / "experiment").glob("*.yaml"):
        assert path.stem in line, line


def _without_root_file_override() -> None:
    """`preexec_fn` of a run as root: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the capability
    bounding set, so that the program executed next, root as it is, obeys file mode bits as any user
    does (root keeps them otherwise, and would write into a read-only directory)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH (linux/capability.h)
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@pytest.mark.slow
def test_read_only_output_dir(tmp_path: Path) -> None:
    """A directory the run may not write into (mode 0555): one error line naming it, exit 1. Run as root
    (CI), the run loses the capabilities that let root ignore the mode bits."""
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    run_dir = tmp_path / "run"
    root = os.geteuid() == 0
    try:
        result = subprocess.run(
            [
                sys.executable,
                str(REPO_ROOT / "train.py"),
                *train_args(run_dir, [f"paths.output_dir={read_only / 'run'}"]),
            ],
            cwd=tmp_path,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=600,
            preexec_fn=_without_root_file_override if root else None,
        )
    except subprocess.SubprocessError as err:  # the capability could not be dropped (no CAP_SETPCAP)
        pytest.skip(f"running as root, and cannot drop CAP_DAC_OVERRIDE for the run: {err}")
    finally:
        read_only.chmod(0o755)
    assert result.returncode == 1, result.stderr[-3000:]
    line = error_line(result)
    assert line.startswith("error: ") and f"{read_only / 'run'}" in line and "Permission denied" in line, line
    assert "Traceback" not in result.stderr
    assert list(read_only.iterdir()) == []
