"""Safe checkpoint loading and averaging."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from tests.conftest import MaliciousPickle
from transformer.checkpoint import CheckpointError, average_checkpoints, load_checkpoint, strip_compile_prefix


def _save(path: Path, scale: float = 1.0) -> Path:
    state_dict = {"w": torch.full((2, 3), scale), "step": torch.tensor(7)}
    torch.save({"state_dict": state_dict, "config": {"task": "translation"}}, path)
    return path


def test_loads_plain_checkpoint(tmp_path: Path) -> None:
    checkpoint = load_checkpoint(_save(tmp_path / "a.ckpt"))
    assert checkpoint["config"] == {"task": "translation"}
    torch.testing.assert_close(checkpoint["state_dict"]["w"], torch.ones(2, 3))


def test_malicious_pickle_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": MaliciousPickle(marker)}, path)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(path)
    assert not marker.exists()
    # The same payload as a raw (non-zip) pickle file is refused too.
    raw = tmp_path / "evil_raw.ckpt"
    raw.write_bytes(pickle.dumps({"state_dict": {}, "payload": MaliciousPickle(marker)}))
    with pytest.raises(CheckpointError):
        load_checkpoint(raw)
    assert not marker.exists()


def test_truncated_checkpoint(tmp_path: Path) -> None:
    path = _save(tmp_path / "a.ckpt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


@pytest.mark.parametrize("kind", ["missing", "directory", "not_a_checkpoint"])
def test_bad_paths(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.ckpt"
    if kind == "directory":
        path.mkdir()
    elif kind == "not_a_checkpoint":
        torch.save({"weights": torch.ones(1)}, path)
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path)


def test_average_of_copies_is_identity(tmp_path: Path) -> None:
    path = _save(tmp_path / "a.ckpt", scale=0.1)
    averaged = average_checkpoints([path, path, path])
    assert torch.equal(averaged["state_dict"]["w"], load_checkpoint(path)["state_dict"]["w"])
    assert averaged["config"] == {"task": "translation"}


def test_average_is_mean_and_keeps_integer_buffers(tmp_path: Path) -> None:
    paths = [_save(tmp_path / f"{i}.ckpt", scale=float(i)) for i in range(1, 4)]
    averaged = average_checkpoints(paths)
    torch.testing.assert_close(averaged["state_dict"]["w"], torch.full((2, 3), 2.0))
    assert averaged["state_dict"]["step"].item() == 7


def test_average_refuses_mismatched_shapes(tmp_path: Path) -> None:
    a = _save(tmp_path / "a.ckpt")
    b = tmp_path / "b.ckpt"
    torch.save({"state_dict": {"w": torch.ones(3, 3), "step": torch.tensor(1)}}, b)
    with pytest.raises(CheckpointError, match="shape"):
        average_checkpoints([a, b])


def test_strip_compile_prefix() -> None:
    stripped = strip_compile_prefix({"model._orig_mod.encoder.w": torch.ones(1)})
    assert list(stripped) == ["model.encoder.w"]
