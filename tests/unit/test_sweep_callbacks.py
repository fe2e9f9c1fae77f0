"""transformer.sweep_callbacks: the Optuna resume callback on a composed config, and the Lightning
callback that fails a diverged run."""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

import lightning as L
import optuna
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from torch import nn

from tests.conftest import REPO_ROOT
from transformer.sweep_callbacks import FailOnNonFiniteLoss, ResumeOptunaStudy, sqlite_path


def _compose(overrides: list[str]) -> DictConfig:
    os.environ.setdefault("PROJECT_ROOT", str(REPO_ROOT))
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO_ROOT / "configs")):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    GlobalHydra.instance().clear()
    HydraConfig.instance().set_config(cfg)
    return cfg


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:////abs/dir/optuna.db", Path("/abs/dir/optuna.db")),
        ("sqlite:///rel/optuna.db?timeout=30", Path("rel/optuna.db")),
        ("sqlite:///:memory:", None),
        ("postgresql://user@host/db", None),
    ],
)
def test_sqlite_path(url: str, path: Path | None) -> None:
    assert sqlite_path(url) == path


def test_resume_creates_the_directory_then_offsets_the_seed(tmp_path: Path) -> None:
    overrides = ["hparams_search=quickstart_optuna", f"paths.log_dir={tmp_path}"]
    cfg = _compose(overrides)
    database = tmp_path / "train" / "sweeps" / "quickstart_optuna" / "optuna.db"
    assert cfg.hydra.sweeper.storage == f"sqlite:///{database}"
    ResumeOptunaStudy().on_multirun_start(config=cfg)
    assert database.parent.is_dir() and cfg.hydra.sweeper.sampler.seed == 42  # a new study: untouched

    study = optuna.create_study(study_name="quickstart_optuna", storage=cfg.hydra.sweeper.storage)
    for value in (1.0, 2.0):
        study.tell(study.ask(), value)
    cfg = _compose(overrides)
    ResumeOptunaStudy().on_multirun_start(config=cfg)
    assert cfg.hydra.sweeper.sampler.seed == 44  # 42 + the 2 trials so far

    other = _compose([*overrides, "hydra.sweeper.study_name=another"])  # same file, other study
    ResumeOptunaStudy().on_multirun_start(config=other)
    assert other.hydra.sweeper.sampler.seed == 42


def test_every_job_of_a_run_gets_the_runs_start_time(tmp_path: Path, monkeypatch) -> None:
    import hydra.core.utils

    start = datetime(2030, 1, 2, 3, 4, 5)
    ticks = iter(range(100))

    class Clock(datetime):  # every call a second later, as if jobs started one after another
        @classmethod
        def now(cls, tz=None):
            return start + timedelta(seconds=next(ticks))

    monkeypatch.setattr(hydra.core.utils, "datetime", Clock)
    overrides = ["hparams_search=quickstart_optuna", f"paths.log_dir={tmp_path}"]
    launching = _compose(overrides)
    ResumeOptunaStudy().on_multirun_start(config=launching)
    subdirs = []
    for num in (0, 1):  # what Hydra's launchers do for each job (or each rank of a multi-node job)
        job = _compose([*overrides, "hydra.sweeper.n_trials=1"])
        OmegaConf.copy_cache(from_config=launching, to_config=job)
        with read_write(job.hydra.job), open_dict(job.hydra.job):
            job.hydra.job.num = num
        subdirs.append(job.hydra.sweep.subdir)
    started = subdirs[0].removesuffix("_0")
    assert subdirs == [f"{started}_0", f"{started}_1"]
    assert start <= datetime.strptime(started, "%Y-%m-%d_%H-%M-%S") < Clock.now() - timedelta(seconds=2)


def test_callback_ignores_other_sweepers(tmp_path: Path) -> None:
    cfg = _compose([f"paths.log_dir={tmp_path}"])  # basic sweeper: no storage
    ResumeOptunaStudy().on_multirun_start(config=cfg)
    assert not (tmp_path / "train").exists()


class _Regression(L.LightningModule):
    """y = 2x on random data; from batch `nan_from` on the loss is NaN."""

    def __init__(self, nan_from: int | None) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.nan_from = nan_from

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        if self.nan_from is not None and batch_idx >= self.nan_from:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        x = torch.randn(32, 4)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, 2 * x[:, :1]), batch_size=4)


def _fit(module: L.LightningModule, callback: FailOnNonFiniteLoss) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=8,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(module)
    return trainer


@pytest.mark.parametrize(("every_n_steps", "step"), [(1, 3), (2, 4)])
def test_non_finite_loss_fails_the_run(every_n_steps: int, step: int) -> None:
    with pytest.raises(FloatingPointError, match=rf"training loss is nan at step {step} "):
        _fit(_Regression(nan_from=2), FailOnNonFiniteLoss(every_n_steps))


def test_finite_loss_trains_to_the_end() -> None:
    assert _fit(_Regression(nan_from=None), FailOnNonFiniteLoss()).global_step == 8
    with pytest.raises(ValueError, match="every_n_steps"):
        FailOnNonFiniteLoss(0)
