"""Shared test fixtures and helpers: seeded RNG, one intra-op thread for tiny models, paths to the real
datasets, GPU skipping, the GPU's code path on the CPU, a disk that fills, running the entry points as a
user does, a planted malicious pickle, and a snapshot of a directory (to prove a refused command changed
nothing). Helpers that only some test modules share are in tests/helpers/, one module per subject."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker (and every process it starts) gets its share of the cores: two
    workers of two intra-op threads each on two cores wait on each other (the unit tests under `-n 2` on
    2 cores: 207 s with torch's default of 2 threads, 162 s with 1). A given OMP_NUM_THREADS is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by the processes the tests start
    torch.set_num_threads(threads)


_share_the_cores()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# The tests that need a real dataset find it through these variables (unset: skipped, saying how to run them).
DATASETS = {
    "MULTI30K_DIR": (
        "/path/to/multi30k",
        "the official data/task1/raw layout: train.de.gz, train.en.gz, ...",
    ),
    "SST2_DIR": ("/path/to/SST-2", "the GLUE layout: train.tsv[.gz], dev.tsv"),
}


def _data_dir(env: str) -> Path:
    value = os.environ.get(env)
    if not value:
        example, layout = DATASETS[env]
        pytest.skip(f"needs the real data: run `{env}={example} pytest` ({layout}); .ci/run sets it")
    path = Path(value)
    if not path.is_dir():
        pytest.fail(f"{env}={value} is not a directory")
    return path


@pytest.fixture
def multi30k_dir() -> Path:
    """The Multi30k `data/task1/raw` directory from $MULTI30K_DIR."""
    return _data_dir("MULTI30K_DIR")


@pytest.fixture
def sst2_dir() -> Path:
    """The SST-2 GLUE directory from $SST2_DIR."""
    return _data_dir("SST2_DIR")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; two threads on a busy 2-core machine spin for seconds.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cuda_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's code path on the CPU: the kernels' CUDA choices, the fused SDPA one launch
    (`take_the_cuda_path` in tests/helpers/launches.py)."""
    from tests.helpers.launches import take_the_cuda_path

    take_the_cuda_path(monkeypatch)


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path, int], None]:
    """`full_disk(directory, budget)`: from now on, files under `directory` take `budget` more bytes."""
    from tests.helpers.disk import filling_disk

    return filling_disk(monkeypatch)


def cli_env(**env: str) -> dict[str, str]:
    """The environment of a command-line run: no inherited wandb settings, unbuffered, one-line errors."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    environ.update(PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0", **env)
    environ.pop("PROJECT_ROOT", None)  # the entry points find the repository themselves
    return environ


def run_script(
    script: str | Path,
    args: list[str],
    *,
    cwd: Path = REPO_ROOT,
    stdin: str | None = None,
    timeout: float = 900,
    env: dict[str, str] | None = None,
    fresh: bool = False,
    on_start: Callable[[int], object] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python SCRIPT ARGS...` as a user runs it (a script of the repository, or any path): forked from the
    warm interpreter of tests/forkserver.py, or with `fresh` a new interpreter; `on_start(pid)` as there."""
    from tests import forkserver

    return forkserver.run(
        [sys.executable, str(REPO_ROOT / script), *args],
        input=stdin,
        cwd=cwd,
        env=cli_env() if env is None else env,
        timeout=timeout,
        on_start=on_start,
        fresh=fresh,
    )


class MaliciousPickle:
    """Unpickling this runs a shell command that creates `marker`: the classic malicious checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file below `directory` with its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()}
