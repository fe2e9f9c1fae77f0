"""Multi-node DDP (docs/cluster.md) on one machine: two "nodes" of one process each, started as two commands
with Lightning's variables (MASTER_ADDR=127.0.0.1, MASTER_PORT, NODE_RANK=0/1) and `trainer=ddp_cpu
trainer.num_nodes=2 trainer.devices=1` (gloo, CPU), as each node of a cluster job starts `train.py`; both
write into one run directory, as on a cluster's shared filesystem.

They train exactly as one node with two processes does (the loss at every step and the final weights,
bitwise); a node killed mid-run ends the other at once with one `error:` line naming the checkpoint to
resume from, and resuming from it on one node finishes the run as if never stopped."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import TINY, run_script
from tests.helpers.repo import cli_env

pytestmark = pytest.mark.slow

# 10 optimizer steps (5 per epoch on each of the 2 ranks), no final test; last.ckpt every 2 steps
RUN = [*TINY, "logger=csv", "test=false", "callbacks.last_checkpoint.every_n_train_steps=2"]
TWO_NODES = ["trainer=ddp_cpu", "trainer.num_nodes=2", "trainer.devices=1"]
ONE_NODE = ["trainer=ddp_cpu"]  # 2 processes, the second started by Lightning's launcher
TIMEOUT = 600  # seconds any one command may take (a bound, not an expectation: each takes 10-30 s)
# every process gets the same number of intra-op threads (Lightning would give a node's one process all
# the cores and each of a node's two processes half of them): float sums then round the same way
THREADS = os.environ.get("OMP_NUM_THREADS", "1")
DDP_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in cli_env(OMP_NUM_THREADS=THREADS).items() if k not in DDP_VARIABLES}
    return {**env, **variables}


def _train(args: list[str], cwd: Path, env: dict[str, str], running: set[int]) -> tuple[float, object]:
    """`python train.py ARGS` with `env`, its pid in `running` while it runs. Returns when it ended
    (time.monotonic()) and its CompletedProcess."""
    mine: list[int] = []

    def started(pid: int) -> None:
        mine.append(pid)
        running.add(pid)

    try:
        done = run_script("train.py", args, cwd=cwd, env=env, timeout=TIMEOUT, on_start=started)
    finally:
        running.difference_update(mine)
    return time.monotonic(), done


def _launch(pool: ThreadPoolExecutor, args: list[str], cwd: Path, running: set[int], **env: str) -> Future:
    return pool.submit(_train, args, cwd, _env(**env), running)


def _two_nodes(
    pool: ThreadPoolExecutor, args: list[str], node1: list[str], cwd: Path, running: set[int]
) -> list[Future]:
    """Node 0 (the master: rank 0) and node 1, each one process, meeting on a free port of 127.0.0.1."""
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    return [
        _launch(pool, [*args, *TWO_NODES], cwd, running, NODE_RANK="0", **master),
        _launch(pool, [*args, *TWO_NODES, *node1], cwd, running, NODE_RANK="1", **master),
    ]


def _kill_all(running: set[int]) -> None:
    """Every command still running (after a failed assertion or a timeout elsewhere) ends with the test."""
    for pid in list(running):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _curve(run_dir: Path) -> dict[int, float]:
    """step -> the logged training loss (rank 0's, CSV logger)."""
    with (run_dir / "csv" / "metrics.csv").open() as f:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row["train/loss"]}


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The data prepared once (docs/cluster.md: before starting multi-node jobs), then, side by side, one
    node of 2 processes (`one_node`) and 2 nodes of 1 process (`two_nodes`) training the same run."""
    root = tmp_path_factory.mktemp("multinode")
    cache = root / "cache"
    args = [*RUN, f"paths.cache_dir={cache}"]
    dirs = {"prepare": root / "prepare", "one_node": root / "one_node", "two_nodes": root / "two_nodes"}
    running: set[int] = set()
    futures: list[Future] = []
    with ThreadPoolExecutor(max_workers=3) as pool:
        try:
            prepared = [
                _launch(pool, [*args, "train=false", f"hydra.run.dir={dirs['prepare']}"], root, running)
            ]
            futures += prepared
            _, done = prepared[0].result()
            assert done.returncode == 0, done.stderr[-3000:]
            futures.append(
                _launch(pool, [*args, *ONE_NODE, f"hydra.run.dir={dirs['one_node']}"], root, running)
            )
            futures += _two_nodes(pool, [*args, f"hydra.run.dir={dirs['two_nodes']}"], [], root, running)
            for future in futures:
                _, done = future.result()
                assert done.returncode == 0, done.stderr[-3000:]
        finally:
            _kill_all(running)
    return {"root": root, "cache": cache, **dirs}


def test_two_nodes_train_exactly_as_one_node_with_two_processes(runs: dict[str, Path]) -> None:
    one, two = runs["one_node"], runs["two_nodes"]
    reference = _curve(one)
    assert sorted(reference) == list(range(10))  # every step of the 2 epochs logged
    assert _curve(two) == reference  # bitwise: the same batches per rank, the same all-reduced gradients
    for name in ("last.ckpt", "epoch_001.ckpt"):
        expected, got = _weights(one / "checkpoints" / name), _weights(two / "checkpoints" / name)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(got[key], value), (name, key)
    assert torch.load(two / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 10


def test_a_killed_node_ends_the_other_with_one_line_and_a_resumable_checkpoint(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Node 1 SIGKILLs itself at the end of step 7 (last.ckpt holds step 6). Node 0 notices in its next
    collective (a closed socket: at once, not after trainer.strategy.timeout) and exits 1 with one line
    naming the lost process and last.ckpt, no traceback. Resumed from it on one node (2 processes), the
    run ends with the straight run's losses and weights."""
    run_dir = tmp_path / "killed"
    args = [
        *RUN,
        f"paths.cache_dir={runs['cache']}",
        f"hydra.run.dir={run_dir}",
        "trainer.strategy.timeout.seconds=60",
    ]
    kill = ["+callbacks.kill._target_=tests.helpers.callbacks.SignalAtStep", "+callbacks.kill.step=7"]
    running: set[int] = set()
    futures: list[Future] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            futures = _two_nodes(pool, args, [*kill, "+callbacks.kill.signal=SIGKILL"], tmp_path, running)
            (ended0, node0), (ended1, node1) = (future.result() for future in futures)
        finally:
            _kill_all(running)
    assert node1.returncode == -signal.SIGKILL, node1.stderr[-3000:]
    assert ended0 - ended1 < 60, f"node 0 ended {ended0 - ended1:.1f} s after node 1 was killed"
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == 6
    assert node0.returncode == 1, node0.stderr[-3000:]
    assert "Traceback" not in node0.stderr and "Traceback" not in node0.stdout
    lines = node0.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]]
    assert lines[-1].startswith(
        "error: training stopped at step 7: another process of this 2-process DDP run was lost (gloo: "
    ), lines[-1]
    assert lines[-1].endswith(
        f"; the last checkpoint written is {ckpt} (step 6): resume with ckpt_path={ckpt}"
    ), lines[-1]
    assert not [p.name for p in ckpt.parent.iterdir() if p.suffix == ".tmp"]

    resumed_dir = tmp_path / "resumed"
    resume = [*RUN, f"paths.cache_dir={runs['cache']}", *ONE_NODE, f"ckpt_path={ckpt}"]
    _, done = _train([*resume, f"hydra.run.dir={resumed_dir}"], tmp_path, _env(), set())
    assert done.returncode == 0, done.stderr[-3000:]
    reference = _curve(runs["one_node"])
    stopped, resumed = _curve(run_dir), _curve(resumed_dir)
    assert sorted(resumed) == [6, 7, 8, 9]  # from the first step after the checkpoint
    assert {**stopped, **resumed} == reference
    expected, got = (
        _weights(runs["one_node"] / "checkpoints" / "last.ckpt"),
        _weights(resumed_dir / "checkpoints" / "last.ckpt"),
    )
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_a_frozen_node_ends_the_other_after_the_configured_timeout(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Node 1 stops (SIGSTOP) at the end of step 7: its sockets stay open, so node 0 waits in its next
    collective for `trainer.strategy.timeout.seconds`, then exits 1 with the same line, naming the timeout.
    (Short here; torch's 30 minutes by default.)"""
    run_dir = tmp_path / "frozen"
    timeout = 20
    args = [
        *RUN,
        f"paths.cache_dir={runs['cache']}",
        f"hydra.run.dir={run_dir}",
        f"trainer.strategy.timeout.seconds={timeout}",
    ]
    stop = ["+callbacks.stop._target_=tests.helpers.callbacks.SignalAtStep", "+callbacks.stop.step=7"]
    running: set[int] = set()
    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            node0, node1 = _two_nodes(
                pool, args, [*stop, "+callbacks.stop.signal=SIGSTOP"], tmp_path, running
            )
            ended0, done = node0.result()
        finally:
            _kill_all(running)  # node 1, stopped
    assert node1.result()[1].returncode == -signal.SIGKILL
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    frozen = ckpt.stat().st_mtime  # saved at the end of step 6, just before node 1 stopped
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "error: training stopped at step 7: another process of this 2-process DDP run was lost"
    )
    assert f", no answer within trainer.strategy.timeout ({timeout} s)); " in line, line
    assert line.endswith(f"the last checkpoint written is {ckpt} (step 6): resume with ckpt_path={ckpt}")
    waited = time.time() - (time.monotonic() - ended0) - frozen  # from the save to node 0's end
    assert timeout <= waited < timeout + 60, waited
