"""The quickstart on a real full filesystem (a 34 MB tmpfs, as root): the second epoch's checkpoint does not
fit, and the run ends with one `error:` line (the path, "no space left on device", the free space, the
checkpoint's size), exit status 1, no traceback on the console (the run's train.log has it), no temporary
file, and the first epoch's checkpoints whole. With room again, the same command continues from the last
whole checkpoint and finishes. The in-process checks of every writer are tests/unit/test_disk_full.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import run_script

# the quickstart, cut to the fewest steps that still write the second epoch's checkpoint
COMMAND = [
    "experiment=quickstart",
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "test=false",
    "++trainer.enable_progress_bar=false",
    "callbacks.rich_progress_bar=null",
    "callbacks.model_summary=null",
]


def _mount(directory: Path, size: str, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join([*options, f"size={size}"]), "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 34 MB tmpfs at tmp_path/disk (unmounted afterwards): room for two quickstart checkpoints only."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root: run as root to fill a real filesystem")
    directory = tmp_path / "disk"
    directory.mkdir()
    mounted = _mount(directory, "34m")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN?): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def _train(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return run_script(
        "train.py", [*COMMAND, f"hydra.run.dir={run_dir}"], timeout=600
    )  # a real process, forked


def test_a_full_disk_ends_the_run_in_one_line_and_the_same_command_continues(small_filesystem: Path) -> None:
    run_dir = small_filesystem / "run"
    full = _train(run_dir)
    console = full.stdout + full.stderr
    assert full.returncode == 1, console[-3000:]
    lines = [line for line in console.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, console[-3000:]
    assert re.fullmatch(
        rf"error: {re.escape(str(run_dir / 'checkpoints'))}/(last|epoch_001)\.ckpt: no space left on device "
        r"\(\d+\.\d MB free\) writing the checkpoint of 12\.\d MB; free some space, then run the same "
        r"command again \(train.py continues from the last whole checkpoint\)",
        lines[0],
    ), lines[0]
    assert "Traceback" not in console and "Error executing job" not in console
    log = (run_dir / "train.log").read_text()
    assert "Traceback" in log and "OSError: [Errno 28] No space left on device" in log
    assert not [p for p in small_filesystem.rglob("*") if p.name.endswith(".tmp")]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["epoch_000.ckpt", "last.ckpt"]
    for name in checkpoints:  # the first epoch's checkpoints are whole
        assert torch.load(run_dir / "checkpoints" / name, weights_only=True)["global_step"] == 2

    # room again (as if the user freed space): the same command continues from last.ckpt and finishes
    assert _mount(small_filesystem, "64m", "remount").returncode == 0
    again = _train(run_dir)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"Continuing the earlier run in {run_dir}" in (run_dir / "train.log").read_text()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["global_step"] == 4 and metrics["epoch"] == 2
