"""`trainer.max_steps` shorter than the way to the first validation: Lightning does not validate at the
end of such a run (the rule stays), and the run says so when it starts, with the setting that does
(`transformer.training.validation_schedule`, called by every task's `on_train_start`)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from transformer.training.base import TaskBase
from transformer.training.validation_schedule import max_steps_before_validation


class _Recorded(BoringModel):
    """64 training batches an epoch; records the warning and the steps where validation ran."""

    def __init__(self) -> None:
        super().__init__()
        self.warning: str | None = None
        self.validated_at: list[int] = []

    def on_train_start(self) -> None:
        self.warning = max_steps_before_validation(self.trainer)

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.validated_at.append(self.trainer.global_step)


def _fit(tmp_path: Path, **options: Any) -> _Recorded:
    model = _Recorded()
    trainer = L.Trainer(
        default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1, **options,
    )  # fmt: skip
    trainer.fit(model)
    return model


def test_max_steps_within_the_first_epoch_is_said_at_the_start_and_the_suggestion_validates(
    tmp_path: Path,
) -> None:
    stopped = _fit(tmp_path, max_steps=10)
    assert stopped.validated_at == []  # Lightning's rule: no validation at the end of a max_steps run
    assert stopped.warning is not None and stopped.warning.startswith(
        "trainer.max_steps=10 ends training after 10 batches, before the first validation (at batch 64; "
        "an epoch has 64)"
    )
    assert stopped.warning.endswith("add trainer.val_check_interval=10")
    assert "\n" not in stopped.warning
    fixed = _fit(tmp_path, max_steps=10, val_check_interval=10)
    assert fixed.validated_at == [10] and fixed.warning is None


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"max_steps": 10, "accumulate_grad_batches": 2}, "trainer.val_check_interval=20"),
        ({"max_steps": 40, "check_val_every_n_epoch": 2, "max_epochs": 3}, "trainer.val_check_interval=40"),
        (
            {"max_steps": 100, "check_val_every_n_epoch": 2, "max_epochs": 3},
            "trainer.check_val_every_n_epoch=1 trainer.val_check_interval=1.0",
        ),
    ],
    ids=["accumulated_batches", "within_the_first_epoch", "past_the_first_epoch"],
)
def test_the_warning_counts_batches_and_epochs_between_validations(
    tmp_path: Path, options: dict[str, Any], fix: str
) -> None:
    stopped = _fit(tmp_path, **options)
    assert stopped.validated_at == [] and stopped.warning is not None and stopped.warning.endswith(fix)


@pytest.mark.parametrize(
    "options",
    [
        {"max_steps": 64},  # validated at the end of the epoch, its last step
        {"max_steps": -1, "max_epochs": 1},
        {"max_steps": 10, "limit_val_batches": 0},  # validation switched off: nothing to warn about
        {"max_steps": 10, "val_check_interval": 5},
    ],
    ids=["one_epoch", "no_max_steps", "no_validation", "validates_within"],
)
def test_no_warning_where_validation_runs_or_is_off(tmp_path: Path, options: dict[str, Any]) -> None:
    model = _Recorded()
    trainer = L.Trainer(
        default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, **{"limit_val_batches": 1, **options},
    )  # fmt: skip
    trainer.fit(model)
    assert model.warning is None


def test_every_task_warns_at_train_start(caplog: pytest.LogCaptureFixture) -> None:
    trainer = SimpleNamespace(
        max_steps=10, global_step=0, limit_val_batches=1.0, num_training_batches=246, val_check_batch=246,
        check_val_every_n_epoch=1, accumulate_grad_batches=1, is_global_zero=True,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        TaskBase.on_train_start(SimpleNamespace(trainer=trainer))
    assert [r.getMessage()[:60] for r in caplog.records] == [
        "trainer.max_steps=10 ends training after 10 batches, before "
    ]
