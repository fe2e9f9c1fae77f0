"""Shared fixtures and hooks only: seeded RNG, one intra-op thread for tiny models, the real datasets' paths,
GPU skipping, the GPU's code path on the CPU, a disk that fills; the cores shared among pytest-xdist's
workers. Helpers (running the entry points, tiny models, ...) live in tests/helpers/, one module per
subject."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.datasets import data_dir


def pytest_configure(config: pytest.Config) -> None:
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


@pytest.fixture
def multi30k_dir() -> Path:
    """The Multi30k `data/task1/raw` directory from $MULTI30K_DIR."""
    return data_dir("MULTI30K_DIR")


@pytest.fixture
def sst2_dir() -> Path:
    """The SST-2 GLUE directory from $SST2_DIR."""
    return data_dir("SST2_DIR")


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
