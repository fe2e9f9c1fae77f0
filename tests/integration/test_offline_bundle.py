"""scripts/offline_bundle.sh and benchmarks.gpu.bench_gpu on a stand-in for a bare offline GPU box: a venv
that sees only some of the installed packages (tests/helpers/offline_env.py), no network (pip --no-index
against a local wheel folder), the project not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.offline_env import closure, image_venv, installed, repack_wheel
from tests.helpers.repo import REPO_ROOT

pytestmark = pytest.mark.slow

LACKS = {"hydra-core", "omegaconf", "antlr4-python3-runtime"}  # pure Python: repacked into a wheel folder
GPU_IMAGE = {"torch", "lightning", "transformers", "tokenizers", "numpy", "pyarrow"}  # the example


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def _run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=600)


def _imports(python: Path, module: str, cwd: Path) -> bool:
    return _run([str(python), "-c", f"import {module}"], cwd).returncode == 0


def test_bundle_runs_train_py_on_a_target_without_the_project_or_hydra(tmp_path: Path) -> None:
    image = set(installed()) - LACKS - {"setuptools", "wheel"}  # pip: a GPU image has it
    python = image_venv(tmp_path / "target", image)
    assert _imports(python, "lightning", tmp_path)  # and torch, which it imports
    assert not _imports(python, "hydra", tmp_path) and not _imports(python, "transformer", tmp_path)
    have = tmp_path / "have.txt"
    have.write_text(_run([str(python), "-m", "pip", "freeze"], tmp_path).stdout)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in LACKS:
        repack_wheel(name, wheels)

    bundle = tmp_path / "bundle"
    built = _run(
        ["bash", str(REPO_ROOT / "scripts" / "offline_bundle.sh"), str(bundle), "--have", str(have)],
        tmp_path, PYTHON=sys.executable, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels),
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    bundled = {p.name.split("-")[0].lower().replace("_", "-") for p in (bundle / "wheels").glob("*.whl")}
    assert bundled == LACKS  # what the target lacks, nothing it has (torch, lightning, ...)
    assert (bundle / "repo" / "train.py").is_file() and not (bundle / "repo" / ".git").exists()
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    assert size < 60 * 2**20, size

    elsewhere = tmp_path / "elsewhere"  # run.sh from any folder, with the target's python first on PATH
    elsewhere.mkdir()
    path = f"{python.parent}:{os.environ['PATH']}"
    # the first call installs the wheels, the second finds them installed (and imports them from there)
    done = _run(["bash", str(bundle / "run.sh"), "python train.py --cfg job"], elsewhere, PATH=path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "model:" in done.stdout and "trainer:" in done.stdout, done.stdout[-1000:]
    marker = bundle / "site-packages" / ".installed"
    assert marker.is_file()
    stamp = marker.stat().st_mtime_ns
    where = "import hydra, omegaconf; print(hydra.__file__, omegaconf.__file__)"
    done = _run(["bash", str(bundle / "run.sh"), f"python -c '{where}'"], elsewhere, PATH=path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count(str(bundle / "site-packages")) == 2, done.stdout
    assert marker.stat().st_mtime_ns == stamp  # not installed again
    assert not list(elsewhere.iterdir())  # it ran in the bundled repository


def test_bundle_refuses_a_used_folder_and_a_malformed_freeze_file(tmp_path: Path) -> None:
    script = str(REPO_ROOT / "scripts" / "offline_bundle.sh")
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    done = _run(["bash", script, str(used)], tmp_path, PYTHON=sys.executable)
    assert done.returncode == 1 and done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1
    assert "not an empty folder" in done.stderr and (used / "keep.txt").read_text() == "mine"
    have = tmp_path / "have.txt"
    have.write_text("torch==2.5.1\n!!not a requirement\n")
    done = _run(["bash", script, str(tmp_path / "new"), "--have", str(have)], tmp_path, PYTHON=sys.executable)
    assert done.returncode == 1 and f"{have}:2" in done.stderr and len(done.stderr.splitlines()) == 1
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"  # a folder the user made is emptied by a failed build, never removed
    empty.mkdir()
    done = _run(["bash", script, str(empty), "--have", str(have)], tmp_path, PYTHON=sys.executable)
    assert done.returncode == 1 and f"{have}:2" in done.stderr
    assert empty.is_dir() and not list(empty.iterdir())


def test_bench_gpu_runs_from_a_plain_copy_with_only_a_gpu_images_packages(tmp_path: Path) -> None:
    python = image_venv(tmp_path / "target", closure(GPU_IMAGE))
    assert not _imports(python, "datasets", tmp_path) and not _imports(python, "hydra", tmp_path)
    copy = tmp_path / "copy"  # the tracked files, nothing installed
    listed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files"], capture_output=True, text=True).stdout
    for name in listed.split():
        if (REPO_ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / name).write_bytes((REPO_ROOT / name).read_bytes())
    done = _run(
        [str(python), "-m", "benchmarks.gpu.bench_gpu", "--smoke", "--models", "ours,torch",
         "--results-dir", str(tmp_path / "results")],
        copy,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert result["train"]["ours"]["tok_s"] > 0 and result["train"]["torch"]["tok_s"] > 0
    assert result["decode"]["ctranslate2"] == "ctranslate2 not installed"
    assert result["decode"]["batch4_greedy"]["ours"]["sent_s"] > 0
