"""transformer.training.optuna_trial: a pruned trial stops right after the validation that pruned it, also
mid-epoch in its first epoch (the Trainer's `min_epochs=1`, the project's default, would train on to the
epoch's end: the steps pruning is there to save)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

from transformer.training.optuna_trial import PRUNED_AT_STEP, OptunaTrialReporter

# the Optuna sweeper is an extra (`aiayn[sweep]`): a GPU image without it still runs `pytest -m gpu`
optuna = pytest.importorskip("optuna")


class _AlwaysPrune(optuna.pruners.BasePruner):
    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return True


class _Regression(L.LightningModule):
    """A linear model that logs `val/score` at each validation: the smallest module a Trainer fits."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.linear(x), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/score", -torch.nn.functional.mse_loss(self.linear(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _default_sanity_steps() -> int:
    """`num_sanity_val_steps` of configs/trainer/default.yaml: what every trial of a sweep runs with."""
    config = yaml.safe_load((Path(__file__).parents[2] / "configs/trainer/default.yaml").read_text())
    return int(config["num_sanity_val_steps"])


@pytest.mark.parametrize("sanity_steps", [0, _default_sanity_steps()])
def test_a_pruned_trial_stops_mid_epoch_despite_min_epochs(tmp_path: Path, sanity_steps: int) -> None:
    """With the default trainer's sanity check (which logs `val/score` too) nothing is reported before the
    first real validation: a report then would prune the trial at step 0, before it trained."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    trial = study.ask()
    reporter = OptunaTrialReporter(storage, "s", trial.number, "val/score", pruner=_AlwaysPrune())
    data = TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    trainer = L.Trainer(
        max_epochs=3, min_epochs=1, val_check_interval=0.25, num_sanity_val_steps=sanity_steps,
        callbacks=[reporter],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    # 8 batches an epoch, validated every 2: the first validation (step 2) prunes
    trainer.fit(_Regression(), DataLoader(data, batch_size=2), DataLoader(data, batch_size=8))
    assert reporter.pruned_at_step == 2
    assert trainer.global_step == 2
    assert trainer.callback_metrics["optuna/pruned_at_step"] == 2
    (frozen,) = study.get_trials()
    assert frozen.user_attrs[PRUNED_AT_STEP] == 2
    assert list(frozen.intermediate_values) == [2]
