"""The Hydra callbacks of a sweep (transformer.cli.sweeps) on configs composed as the CLI does (the
sweeper's resume and seed offset: tests/unit/test_sweep_space.py)."""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

import hydra.utils
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from tests.helpers.repo import REPO_ROOT
from transformer.cli.sweeps import ResumeOptunaStudy, SweepEndLines


def _compose(overrides: list[str]) -> DictConfig:
    os.environ.setdefault("PROJECT_ROOT", str(REPO_ROOT))
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO_ROOT / "configs")):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    GlobalHydra.instance().clear()
    HydraConfig.instance().set_config(cfg)
    return cfg


def test_configs_of_earlier_versions_still_find_the_callbacks() -> None:
    """The callbacks moved from `transformer.cli.sweep_callbacks` into `transformer.cli.sweeps` (issue 52);
    a config that names the old module gets the same classes."""
    for name in ("ResumeOptunaStudy", "SweepEndLines"):
        old = hydra.utils.get_class(f"transformer.cli.sweep_callbacks.{name}")
        assert old is hydra.utils.get_class(f"transformer.cli.sweeps.{name}")


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


@pytest.mark.parametrize("search", [[], ["hparams_search=quickstart_optuna"]], ids=["grid", "optuna"])
def test_a_finished_sweep_ends_with_its_directory_and_the_report_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], search: list[str]
) -> None:
    """Every sweep (configs/hydra/default.yaml) prints them once its last job is done (issue 51)."""
    cfg = _compose([*search, f"paths.log_dir={tmp_path}"])
    (node,) = [c for c in cfg.hydra.callbacks.values() if c._target_.endswith(".SweepEndLines")]
    callback = hydra.utils.instantiate(node)
    callback.on_multirun_start(config=cfg)
    assert capsys.readouterr().out == ""
    callback.on_multirun_end(config=cfg)
    directory = cfg.hydra.sweep.dir
    assert directory.startswith(str(tmp_path / "train"))
    assert capsys.readouterr().out.splitlines() == [
        f"sweep directory: {directory}",
        f"tables and plots of its jobs: aiayn-sweep-report {directory}",
    ]


def test_a_translating_sweep_keeps_its_stdout_for_the_translations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "translate": {"input": "-"}})
    SweepEndLines().on_multirun_end(config=cfg)
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.splitlines()[0] == f"sweep directory: {tmp_path}"
