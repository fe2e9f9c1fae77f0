"""What a training run prints at its start (transformer/cli/console.py): no Lightning tips, no deprecation
warning of Lightning's own code, no FLOPs column that is always 0, log files without colour codes."""

from __future__ import annotations

import logging
import logging.config
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.model_summary import summarize
from omegaconf import OmegaConf
from rich import get_console

from tests.helpers.configs import compose_train_cfg
from transformer.cli import console
from transformer.training.callbacks import ModelSummary


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_lightning_tips_are_dropped_and_its_other_lines_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    monkeypatch.setattr(rank_zero, "filters", [])  # this test's filter goes with it
    records = _Records()
    rank_zero.addHandler(records)
    try:
        console.quiet_lightning()
        console.quiet_lightning()  # idempotent: one filter
        L.Trainer(
            logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[ModelSummary()]
        )
    finally:
        rank_zero.removeHandler(records)
    assert len(rank_zero.filters) == 1
    assert any(m.startswith("GPU available") for m in records.messages), records.messages
    assert not [m for m in records.messages if "Tip:" in m or "litlogger" in m or "already configured" in m]


def test_the_pytree_deprecation_of_lightnings_own_code_is_silenced() -> None:
    from lightning.pytorch.utilities._pytree import _tree_flatten

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tree_flatten(1)
        if not any("LeafSpec" in str(w.message) for w in caught):
            pytest.skip("this torch does not deprecate LeafSpec")
        caught.clear()
        console.quiet_lightning()
        _tree_flatten(1)
        warnings.warn("other deprecations still show", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["other deprecations still show"]


class _PartlyFrozen(BoringModel):
    """BoringModel's layer (66 parameters) frozen, and a second layer (9) that trains."""

    def __init__(self) -> None:
        super().__init__()
        self.layer.requires_grad_(False)
        self.extra = torch.nn.Linear(2, 3)


def test_model_summary_has_no_flops() -> None:
    summary = summarize(_PartlyFrozen(), max_depth=1)
    with get_console().capture() as captured:
        ModelSummary.summarize(
            summary._get_summary_data(),
            summary.total_parameters,
            summary.trainable_parameters,
            summary.model_size,
            summary.total_training_modes,
            total_flops=0,
        )
    text = captured.get()
    assert "Params" in text and "Total params: 75" in text and "Modules in train mode" in text
    assert "Trainable params: 9" in text and "Non-trainable params: 66" in text
    rows = [line for line in text.splitlines() if "Linear" in line]
    assert len(rows) == 2 and "layer" in rows[0] and "extra" in rows[1]  # every layer a row
    assert "FLOPs" not in text


def test_the_log_file_has_no_colour_codes(tmp_path: Path) -> None:
    """The file handler of the composed Hydra config writes a coloured message as plain text."""
    job_logging = OmegaConf.to_container(
        compose_train_cfg(output_dir=tmp_path).hydra.job_logging, resolve=True
    )
    configurator = logging.config.DictConfigurator(job_logging)
    formatter = configurator.configure_formatter(
        job_logging["formatters"][job_logging["handlers"]["file"]["formatter"]]
    )
    handler = logging.FileHandler(tmp_path / "train.log")
    handler.setFormatter(formatter)
    logger = logging.getLogger("tests.console")
    logger.addHandler(handler)
    try:
        logger.warning("\x1b[1;35mbold magenta\x1b[0m and \x1b[2mdim\x1b[0m")
    finally:
        logger.removeHandler(handler)
        handler.close()
    text = (tmp_path / "train.log").read_text()
    assert "bold magenta and dim" in text and "[tests.console][WARNING]" in text
    assert "\x1b" not in text


def test_the_start_names_the_saved_config_and_the_overrides() -> None:
    line = console.config_message(Path("/runs/x/config.yaml"), ["trainer.max_epochs=1", "seed=3"])
    assert line.startswith("Config: /runs/x/config.yaml (overrides: trainer.max_epochs=1 seed=3; ")
    assert "print_config=true" in line
    assert "(overrides: none;" in console.config_message(Path("c.yaml"), [])


class _DataModule:
    """Stands for the project's datamodule: only its class name keys its state in a checkpoint."""


def _resume_mid_epoch(tmp_path: Path, checkpoint: dict) -> list[str]:
    """Lightning's warnings when a run stopped after 2 of 8 batches resumes, inside `sampler_resumes`."""
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    first = L.Trainer(max_steps=2, limit_val_batches=0, enable_checkpointing=False, **quiet)
    first.fit(BoringModel())
    first.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = L.Trainer(max_steps=3, limit_val_batches=0, enable_checkpointing=False, **quiet)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with console.sampler_resumes(checkpoint, _DataModule()):
            resumed.fit(BoringModel(), ckpt_path=tmp_path / "mid.ckpt")
    assert resumed.global_step == 3
    return [str(w.message) for w in caught]


def test_not_resumable_warning_only_where_no_sampler_state_is_restored(tmp_path: Path) -> None:
    """The datamodule restores its sampler from the checkpoint: Lightning's warning is untrue then."""
    ours = {"_DataModule": {"train_sampler": {"epoch": 0, "batches_yielded": 2}}}
    assert not [m for m in _resume_mid_epoch(tmp_path, ours) if "not resumable" in m]
    other = {"_DataModule": {"tokenizers": {}}}  # a datamodule that saved no sampler position
    assert [m for m in _resume_mid_epoch(tmp_path, other) if "not resumable" in m]
