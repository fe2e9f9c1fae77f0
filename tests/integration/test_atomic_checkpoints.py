"""Reliability promises (docs/reliability.md), checked through the real command line where it matters:
checkpoint files are atomic (a SIGKILL mid-write leaves the previous or the new file whole, a failed save
keeps the previous one, stale temporary files are removed by the next save or load)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import forkserver
from tests.helpers.reliability import (
    load_checkpoint,
)
from tests.helpers.repo import REPO_ROOT, cli_env
from transformer.training import checkpoint_io
from transformer.training.checkpoint_io import AtomicCheckpointIO, atomic_torch_save

_WRITER = """
import sys, torch
from pathlib import Path
from transformer.training.checkpoint_io import atomic_torch_save
path, started = Path(sys.argv[1]), Path(sys.argv[2])
for i in range(1, 10**6):
    atomic_torch_save({"version": i, "weights": torch.full((4_000_000,), float(i))}, path)
    started.touch()  # one version is complete
"""


@pytest.mark.slow
def test_atomic_save_survives_sigkill_mid_write(tmp_path: Path) -> None:
    """A process rewriting a 16 MB checkpoint in a loop, SIGKILLed at random moments: the file is always
    one complete version (old or new), never a truncated mix."""
    path = tmp_path / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    rng = random.Random(1)
    for attempt in range(4):
        started = tmp_path / f"started{attempt}"
        command = [sys.executable, "-c", _WRITER, str(path), str(started)]
        writer = forkserver.in_a_thread(forkserver.run, command, cwd=REPO_ROOT, env=cli_env(), timeout=300)
        with writer as (pid, run):
            deadline = time.monotonic() + 300
            while not started.exists() and not run.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not run.done(), run.result().stderr[-3000:]
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGKILL)
            assert run.result().returncode == -signal.SIGKILL
        checkpoint = load_checkpoint(path)
        assert torch.equal(checkpoint["weights"], torch.full((4_000_000,), float(checkpoint["version"])))
    # the kills left temporary files behind (some of them); the next save clears every one
    atomic_torch_save({"version": 0}, path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    assert load_checkpoint(path) == {"version": 0}


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full (simulated)")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "x": _Unpicklable()}, path)
    assert torch.equal(load_checkpoint(path)["state_dict"]["w"], torch.ones(3))
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temp file left behind
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_temp_files_are_removed_by_the_next_save_or_load(tmp_path: Path) -> None:
    """Temporary files of killed writers on this host go; those of live writers, of other hosts (a shared
    filesystem) and anything else stay."""
    host, dead = checkpoint_io._HOST, _dead_pid()
    stale = tmp_path / f".last.ckpt.{host}.{dead}.abc123.tmp"
    alive = tmp_path / f".last.ckpt.{host}.{os.getppid()}.abc123.tmp"
    foreign = tmp_path / f".last.ckpt.{host}x.{dead}.abc123.tmp"
    other = tmp_path / "notes.tmp"
    for path in (stale, alive, foreign, other):
        path.write_bytes(b"partial")
    atomic_torch_save({"step": 1}, tmp_path / "epoch_001.ckpt")
    assert not stale.exists() and alive.exists() and foreign.exists() and other.exists()

    stale.write_bytes(b"partial")
    AtomicCheckpointIO().load_checkpoint(tmp_path / "epoch_001.ckpt")  # what a resume calls
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["epoch_001.ckpt", alive.name, foreign.name, other.name]
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_atomic_torch_save_round_trip(tmp_path: Path) -> None:
    atomic_torch_save({"a": torch.arange(3)}, tmp_path / "x.ckpt")
    assert torch.equal(load_checkpoint(tmp_path / "x.ckpt")["a"], torch.arange(3))
