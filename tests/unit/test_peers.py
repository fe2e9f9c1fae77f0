"""transformer/training/peers.py: which errors of a collective mean a lost DDP process (the backends' own
messages, as torch 2.13's gloo wrote them in tests/integration/test_multinode.py's runs), and the one line
that names it and the checkpoint to resume from. The processes themselves: test_multinode."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.configs import compose_train_cfg
from transformer.cli import build, checks, errors
from transformer.cli.errors import ConfigError
from transformer.training.peers import PeerLostError, lost_peer_cause, stop_on_lost_peer

RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:233: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
    "application. Check the logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
)
FROZEN = "Application timeout caused pair closure"
WAITED = "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation"


@pytest.mark.parametrize(
    ("err", "cause"),
    [
        (RuntimeError(RESET), "Read error [127.0.0.1]:233: Connection reset by peer"),
        (RuntimeError(FROZEN), FROZEN),
        (RuntimeError(WAITED), "Timed out waiting 10000ms for recv operation"),
        (
            RuntimeError("Connection closed by peer [10.0.0.2]:41231"),
            "Connection closed by peer [10.0.0.2]:41231",
        ),
        (torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1."), None),
        (torch.distributed.DistNetworkError("failed to recv, got 0 bytes"), "failed to recv, got 0 bytes"),
    ],
)
def test_the_backends_words_for_a_lost_process(err: RuntimeError, cause: str | None) -> None:
    assert lost_peer_cause(err) == (cause or str(err).rstrip("."))


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
        RuntimeError("DataLoader timed out after 60 seconds"),  # a loader, not a collective
        ValueError("Connection reset by peer"),  # not raised by a collective
        OSError("Connection reset by peer"),
    ],
)
def test_other_errors_are_not_a_lost_process(err: Exception) -> None:
    assert lost_peer_cause(err) is None


@pytest.fixture(autouse=True)
def process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process group was made (the processes had joined) unless a test says otherwise."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)


def _trainer(
    checkpoints: Path, world_size: int = 2, started: Path | None = None, **strategy
) -> SimpleNamespace:
    """What stop_on_lost_peer reads of a Trainer: its size and step, its checkpoint directories, the
    checkpoint it started from, the strategy's backend and timeout."""
    return SimpleNamespace(
        world_size=world_size,
        global_step=7,
        checkpoint_callbacks=[SimpleNamespace(dirpath=str(checkpoints))],
        callbacks=[],
        ckpt_path=None if started is None else str(started),
        strategy=SimpleNamespace(
            **{"process_group_backend": "gloo", "_timeout": timedelta(minutes=30), **strategy}
        ),
    )


def _checkpoint(path: Path, step: int, mtime: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {}}, path)
    os.utime(path, ns=(mtime, mtime))
    return path


def _line(trainer: SimpleNamespace, err: BaseException) -> str:
    with pytest.raises(PeerLostError) as raised, stop_on_lost_peer(trainer):
        raise err
    assert raised.value.__cause__ is err
    assert "\n" not in str(raised.value)
    return str(raised.value)


def test_the_line_names_the_lost_process_and_the_newest_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    _checkpoint(directory / "epoch_000.ckpt", 5, 1_000)
    last = _checkpoint(directory / "last.ckpt", 6, 2_000)  # written after the epoch's
    assert _line(_trainer(directory), RuntimeError(RESET)) == (
        "training stopped at step 7: another process of this 2-process DDP run was lost (gloo: Read error "
        f"[127.0.0.1]:233: Connection reset by peer); the last checkpoint written is {last} (step 6): resume "
        f"with ckpt_path={last}"
    )
    newer = _checkpoint(directory / "epoch_001.ckpt", 10, 3_000)
    assert f"the last checkpoint written is {newer} (step 10)" in _line(
        _trainer(directory), RuntimeError(RESET)
    )


def test_a_silent_process_is_named_with_the_timeout_it_outlived(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, _timeout=timedelta(seconds=10))
    line = _line(trainer, RuntimeError(FROZEN))
    assert f"(gloo: {FROZEN}, no answer within trainer.strategy.timeout (10 s))" in line


def test_without_a_checkpoint_the_line_says_how_to_get_one(tmp_path: Path) -> None:
    line = _line(_trainer(tmp_path / "none"), RuntimeError(RESET))
    assert line.endswith(
        "; no checkpoint had been written yet, so the run starts over "
        "(callbacks.last_checkpoint.every_n_train_steps=N writes one every N steps)"
    )
    started = _checkpoint(tmp_path / "elsewhere" / "last.ckpt", 3, 1_000)  # a resumed run, nothing new yet
    line = _line(_trainer(tmp_path / "none", started=started), RuntimeError(RESET))
    assert line.endswith(
        f"the last checkpoint written is {started} (step 3): resume with ckpt_path={started}"
    )


def test_processes_that_never_joined_are_named_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    waited = torch.distributed.DistStoreError(
        "Timed out after 11 seconds waiting for clients. 1/2 clients joined."
    )
    assert _line(_trainer(tmp_path, _timeout=timedelta(seconds=10)), waited) == (
        "training could not start: not every process of this 2-process DDP run joined (gloo: Timed out after "
        "11 seconds waiting for clients. 1/2 clients joined, no answer within trainer.strategy.timeout "
        "(10 s)); every node runs the same command with the same MASTER_ADDR and MASTER_PORT and a "
        "NODE_RANK of its own (docs/cluster.md)"
    )


def test_other_errors_and_one_process_pass_through_unchanged(tmp_path: Path) -> None:
    other = RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")
    with pytest.raises(RuntimeError) as raised, stop_on_lost_peer(_trainer(tmp_path)):
        raise other
    assert raised.value is other
    alone = RuntimeError(RESET)  # no other process to lose
    with pytest.raises(RuntimeError) as raised, stop_on_lost_peer(_trainer(tmp_path, world_size=1)):
        raise alone
    assert raised.value is alone


def test_a_lost_process_is_a_one_line_error_of_the_entry_points() -> None:
    assert issubclass(PeerLostError, errors.USER_ERRORS)


@pytest.mark.parametrize("trainer", ["ddp_cpu", "ddp"])
def test_the_timeout_is_a_config_value_checked_by_its_key(
    trainer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checks, "_gpu_available", lambda: True)  # trainer=ddp's accelerator is gpu
    cfg = compose_train_cfg([f"trainer={trainer}", "trainer.strategy.timeout.seconds=12.5"])
    checks.check_config(cfg)
    if trainer == "ddp_cpu":  # trainer=ddp needs CUDA to build: test_config_values builds it with a stand-in
        built = build.instantiate(cfg.trainer, "trainer", logger=False)
        assert built.strategy._timeout == timedelta(seconds=12.5)
    for bad in (0, -1):
        cfg = compose_train_cfg([f"trainer={trainer}", f"trainer.strategy.timeout.seconds={bad}"])
        with pytest.raises(
            ConfigError, match=rf"^`trainer.strategy.timeout.seconds` must be > 0.0, got {bad}$"
        ):
            checks.check_config(cfg)
