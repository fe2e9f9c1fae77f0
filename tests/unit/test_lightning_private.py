"""transformer.training.lightning_private: the Lightning names it relies on exist in the installed Lightning
and mean what it assumes, on a real trainer (a tiny fit on the CPU). A failure here means Lightning
changed: re-check every use in that module, then update `CHECKED_WITH`."""

from __future__ import annotations

import inspect
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from transformer.training import lightning_private


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.seen: list[tuple[bool, bool]] = []  # (should_update_logs, accumulating) after each batch

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.seen.append(
            (lightning_private.should_update_logs(self.trainer), lightning_private.accumulating(self.trainer))
        )

    def validation_step(self, batch, batch_idx) -> None:
        self.log("val/loss", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=1)


def test_the_installed_lightning_is_the_checked_minor_version() -> None:
    installed = ".".join(L.__version__.split(".")[:2])
    assert installed == lightning_private.CHECKED_WITH, (
        f"Lightning {L.__version__} is installed; transformer/training/lightning_private.py was checked "
        f"against {lightning_private.CHECKED_WITH}: re-check its private names, then update CHECKED_WITH"
    )


def test_each_private_name_works_on_a_real_trainer(tmp_path: Path) -> None:
    trainer = L.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        limit_val_batches=1,
        val_check_interval=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
    )
    model = _Tiny()
    # the SIGTERM broadcast of the training loop: replaced on this loop only, called where `when` holds
    loop = trainer.fit_loop.epoch_loop
    assert callable(getattr(type(loop), "_broadcast_sigterm_tensor", None))
    # called before each batch under DDP only (world size > 1): the call is read in the loop's source
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(type(loop).advance)
    calls: list[int] = []
    lightning_private.replace_sigterm_broadcast(trainer, lambda: calls.append(1) is not None)
    assert "_broadcast_sigterm_tensor" in vars(loop)
    loop._broadcast_sigterm_tensor()  # `when` is asked; False: Lightning's broadcast is not run
    assert calls == [1]
    replacement = loop._broadcast_sigterm_tensor
    lightning_private.replace_sigterm_broadcast(trainer, lambda: True)  # a second call changes nothing
    assert loop._broadcast_sigterm_tensor is replacement
    trainer.fit(model, _loader(), _loader())
    # 8 batches, 2 per optimizer step: odd batches accumulate; logs written every 2 optimizer steps
    assert [accumulating for _, accumulating in model.seen] == [True, False] * 4
    assert any(update for update, _ in model.seen) and not all(update for update, _ in model.seen)

    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    progress = lightning_private.val_batch_progress(checkpoint)
    for counts in (progress["total"], progress["current"]):
        assert {"started", "processed", "completed"} <= set(counts)
    assert progress["total"]["completed"] >= 1


def test_the_subprocess_launcher_keeps_its_processes_in_procs() -> None:
    launcher = _SubprocessScriptLauncher(L.fabric.plugins.environments.LightningEnvironment(), 2, 1)
    assert isinstance(launcher.procs, list), "Lightning's subprocess launcher has no `procs` list"

    class _Strategy:
        pass

    class _Trainer:
        strategy = _Strategy()

    _Trainer.strategy.launcher = launcher
    launcher.procs.append(object())
    lightning_private.forget_launched_ranks(_Trainer())  # type: ignore[arg-type]
    assert launcher.procs == []


def test_the_ddp_strategy_keeps_its_timeout() -> None:
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=12))
    assert lightning_private.process_group_timeout(strategy) == timedelta(seconds=12)
    # the process group is made with it (read in the strategy's source)
    assert '{"timeout": self._timeout}' in inspect.getsource(DDPStrategy.setup_distributed)
    assert lightning_private.process_group_timeout(SingleDeviceStrategy("cpu")) is None


@pytest.mark.parametrize("name", ["PATH"])
def test_the_private_types_import(name: str) -> None:
    assert getattr(lightning_private, name) is not None
