"""Safe checkpoint loading and averaging."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.configs import compose_train_cfg
from tests.helpers.refusals import MaliciousPickle
from transformer.checkpoint import (
    CheckpointError,
    average_checkpoints,
    files_in_hint,
    load_checkpoint,
    strip_compile_prefix,
)
from transformer.cli import checks
from transformer.cli.errors import ConfigError
from transformer.cli.evaluate_steps import load_checkpoints


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


LOADERS = {  # each refuses a directory given as the checkpoint: (error, call)
    "load_checkpoint": (CheckpointError, load_checkpoint),
    "evaluate.py": (
        ConfigError,
        lambda path: load_checkpoints(OmegaConf.create({"average_last": None}), path),
    ),
    "train.py": (ConfigError, lambda path: checks.check_config(compose_train_cfg([f"ckpt_path={path}"]))),
}


def test_the_hint_for_a_directory_names_its_checkpoint_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    assert (
        files_in_hint(run)
        == f"give a .ckpt file (there is none in {run}, nor in a checkpoints/ folder under it)"
    )
    _save(folder / "epoch=3-step=40.ckpt")
    assert files_in_hint(run) == f"give one of the .ckpt files in {folder}: epoch=3-step=40.ckpt"
    _save(folder / "last.ckpt")
    assert files_in_hint(run) == files_in_hint(folder) == f"give a .ckpt file, e.g. {folder / 'last.ckpt'}"


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("given", ["run", "run/checkpoints"])
def test_a_directory_given_as_the_checkpoint_names_the_file_meant(
    tmp_path: Path, given: str, loader: str
) -> None:
    """A run directory or its checkpoints/ folder: the message names the file in it (issue 51: it was
    `.../checkpoints/checkpoints/last.ckpt` for the folder)."""
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    _save(folder / "last.ckpt")
    error, call = LOADERS[loader]
    with pytest.raises(error, match="is a directory") as raised:
        call(tmp_path / given)
    message = str(raised.value)
    assert str(folder / "last.ckpt") in message and "checkpoints/checkpoints" not in message
    assert "\n" not in message


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


def test_an_empty_file_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is truncated or corrupt"):
        load_checkpoint(path)


@pytest.mark.parametrize("size", [1, 2, 16, 100, 10_000])
def test_random_bytes_are_a_checkpoint_error_never_the_unpicklers_own(tmp_path: Path, size: int) -> None:
    """40 seeds per size: the unpickler raises IndexError, KeyError, UnicodeDecodeError, struct.error ... on
    random bytes; every one must end as the one-line CheckpointError naming the file."""
    path = tmp_path / "random.ckpt"
    for seed in range(40):
        path.write_bytes(
            torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(seed))
            .byte()
            .numpy()
            .tobytes()
        )
        with pytest.raises(CheckpointError, match=str(path)) as refused:
            load_checkpoint(path)
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["load_checkpoint", "evaluate.py", "model.init_from"])
def test_every_loader_refuses_an_empty_file_in_one_line(tmp_path: Path, name: str) -> None:
    """A 0-byte checkpoint (an interrupted copy) given to an entry point that reads it: a user error (one line
    through `transformer.cli.errors.USER_ERRORS`), never the IndexError of the loader's own handler."""
    from transformer.cli.errors import USER_ERRORS
    from transformer.cli.init_from import take_init_from

    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    init_from = OmegaConf.create(
        {
            "ckpt_path": None,
            "model": {"_target_": "transformer.training.TranslationTask", "init_from": str(path)},
        }
    )
    _, call = LOADERS.get(name, (ConfigError, lambda p: take_init_from(init_from, None, set())))
    with pytest.raises(USER_ERRORS, match=f"{path} is truncated or corrupt") as refused:
        call(path)
    assert "\n" not in str(refused.value)
