"""A Ctrl-C while writing leaves no half-written file (transformer/disk.py's promise): a KeyboardInterrupt
raised inside each kind of writer, part-way through the bytes or just before the rename, leaves the target
whole (the earlier content) or absent, and no temporary file. The writers: `disk.write_text` (every text
and JSON file of a run: metrics.json, config.yaml, hypotheses, the CSV log), a `disk.writing` block
(figures, reports: what the block created is removed) and the checkpoint writer (`torch.save`). The
interrupt stays a KeyboardInterrupt, also where torch.save's zip writer turns it into a RuntimeError."""

from __future__ import annotations

import builtins
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from transformer import disk
from transformer.training.checkpoint_io import AtomicCheckpointIO, atomic_torch_save


class _Interrupting:
    """A file handle that writes the first `budget` bytes it is given, then raises KeyboardInterrupt."""

    def __init__(self, handle: Any, budget: int) -> None:
        self._handle, self._budget = handle, budget

    def write(self, data: Any) -> int:
        if len(data) > self._budget:
            self._handle.write(data[: self._budget])
            self._handle.flush()  # the part is on disk, as it would be when the signal arrives
            raise KeyboardInterrupt
        self._budget -= len(data)
        return self._handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> _Interrupting:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()


@pytest.fixture
def ctrl_c(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, int], None]:
    """`ctrl_c("write", n)`: files opened for writing from now on take n bytes, then Ctrl-C;
    `ctrl_c("rename", 0)`: Ctrl-C when the complete file is about to be renamed into place."""

    def arm(where: str, budget: int) -> None:
        if where == "rename":

            def interrupted(*args: Any, **kwargs: Any) -> None:
                raise KeyboardInterrupt

            monkeypatch.setattr(os, "replace", interrupted)
            return
        real_open, real_fdopen = builtins.open, os.fdopen

        def wrap(handle: Any, mode: str) -> Any:
            return _Interrupting(handle, budget) if any(c in str(mode) for c in "wax+") else handle

        def opener(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            return wrap(real_open(file, mode, *args, **kwargs), mode)

        def fdopener(fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            return wrap(real_fdopen(fd, mode, *args, **kwargs), mode)

        monkeypatch.setattr(builtins, "open", opener)
        monkeypatch.setattr(io, "open", opener)
        monkeypatch.setattr(os, "fdopen", fdopener)

    return arm


WHERE = [("write", 0), ("write", 10), ("rename", 0)]


def _only(directory: Path) -> list[str]:
    """Every name under `directory` (temporary files start with a dot and end in .tmp)."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


# --- write_text: text and JSON ---------------------------------------------------------------------------

TEXTS = [
    ("hypotheses.txt", "first line\n" * 20, "second run\n" * 30),
    ("metrics.json", json.dumps({"test/bleu": 12.5}), json.dumps({"test/bleu": 30.1, "more": "x" * 100})),
]


@pytest.mark.parametrize(("where", "budget"), WHERE)
@pytest.mark.parametrize(("name", "old", "new"), TEXTS, ids=[t[0] for t in TEXTS])
def test_write_text_keeps_the_earlier_file(
    tmp_path: Path, ctrl_c: Callable, where: str, budget: int, name: str, old: str, new: str
) -> None:
    path = disk.write_text(tmp_path / name, old, name)
    ctrl_c(where, budget)
    with pytest.raises(KeyboardInterrupt):
        disk.write_text(path, new, name)
    assert path.read_text() == old
    assert _only(tmp_path) == [name]


@pytest.mark.parametrize(("where", "budget"), WHERE)
@pytest.mark.parametrize(("name", "old", "new"), TEXTS, ids=[t[0] for t in TEXTS])
def test_write_text_of_a_new_file_leaves_nothing(
    tmp_path: Path, ctrl_c: Callable, where: str, budget: int, name: str, old: str, new: str
) -> None:
    ctrl_c(where, budget)
    with pytest.raises(KeyboardInterrupt):
        disk.write_text(tmp_path / name, new, name)
    assert _only(tmp_path) == []


# --- a `writing` block: what it created goes -------------------------------------------------------------


def test_a_writing_block_removes_the_file_it_was_writing(tmp_path: Path, ctrl_c: Callable) -> None:
    ctrl_c("write", 100)
    with (
        pytest.raises(KeyboardInterrupt),
        disk.writing(tmp_path / "figure.png", "the figure") as path,
        open(path, "wb") as handle,
    ):
        handle.write(b"\x89PNG" + bytes(1000))
    assert _only(tmp_path) == []


def test_a_writing_block_removes_the_directory_it_was_filling(tmp_path: Path, ctrl_c: Callable) -> None:
    with pytest.raises(KeyboardInterrupt), disk.writing(tmp_path / "export", "the export") as path:
        path.mkdir()
        (path / "config.json").write_text("{}")
        ctrl_c("write", 10)
        (path / "model.bin").write_bytes(bytes(1000))
    assert _only(tmp_path) == []


# --- checkpoints (torch.save) ----------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "budget"), [*WHERE, ("write", 100_000)])
def test_a_checkpoint_interrupted_keeps_the_earlier_one(
    tmp_path: Path, ctrl_c: Callable, where: str, budget: int
) -> None:
    path = tmp_path / "checkpoints" / "last.ckpt"
    plugin = AtomicCheckpointIO()
    plugin.save_checkpoint({"state_dict": {"w": torch.ones(1000)}, "global_step": 1}, path)
    earlier = path.read_bytes()
    ctrl_c(where, budget)
    with pytest.raises(KeyboardInterrupt):
        plugin.save_checkpoint({"state_dict": {"w": torch.zeros(100_000)}, "global_step": 2}, path)
    assert path.read_bytes() == earlier
    assert _only(tmp_path) == ["checkpoints", "checkpoints/last.ckpt"]


@pytest.mark.parametrize(("where", "budget"), [*WHERE, ("write", 100_000)])
def test_a_new_checkpoint_interrupted_leaves_nothing(
    tmp_path: Path, ctrl_c: Callable, where: str, budget: int
) -> None:
    ctrl_c(where, budget)
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save({"w": torch.ones(100_000)}, tmp_path / "epoch_001.ckpt")
    assert _only(tmp_path) == []
