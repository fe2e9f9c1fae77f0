"""The Lightning callback through which a sweep trial reports to its Optuna trial and is pruned.

The Optuna sweeper (hydra_plugins/aiayn_optuna_sweeper) runs each trial as an ordinary training job;
transformer/cli/sweeps.py adds this callback to the job's callbacks with the study's storage, name and the
trial's number. After every validation (not the sanity check) rank 0 reports `monitor` at the current
optimizer step and asks the pruner; the answer goes to every rank, and a pruned trial stops training the
way early stopping does (`trainer.should_stop`), right after that validation (also within its first epoch,
whatever `trainer.min_epochs` says): checkpoints are kept, the run goes on to test and writes
its `metrics.json` with `optuna/pruned` = 1 and `optuna/pruned_at_step`, and the job ends normally. The
trial's user attribute `pruned_at_step` tells the sweeper to record it as PRUNED.

It also puts `model/params` (the number of trainable parameters) into the run's metrics, an objective
for size/quality sweeps (`optimized_metric=[val/bleu_best,model/params]`).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch

log = logging.getLogger(__name__)

__all__ = ["PRUNED_AT_STEP", "OptunaTrialReporter"]

# the trial's user attribute the sweeper reads (hydra_plugins/aiayn_optuna_sweeper/_study.py, same name)
PRUNED_AT_STEP = "pruned_at_step"


class OptunaTrialReporter(L.Callback):
    """Report `monitor` to trial `trial_number` of study `study_name` in `storage` after each validation;
    stop training when `pruner` (an optuna pruner, or None: report only) says so. `monitor` None (several
    objectives, which Optuna does not prune) reports nothing."""

    def __init__(
        self, storage: str, study_name: str, trial_number: int, monitor: str | None, pruner: Any = None
    ) -> None:
        self.storage = storage
        self.study_name = study_name
        self.trial_number = int(trial_number)
        self.monitor = monitor
        self.pruner = pruner
        self.pruned_at_step: int | None = None
        self._trial: Any = None

    def _optuna_trial(self) -> Any:
        if self._trial is None:
            import optuna

            study = optuna.load_study(study_name=self.study_name, storage=self.storage, pruner=self.pruner)
            (frozen,) = [t for t in study.get_trials(deepcopy=False) if t.number == self.trial_number]
            self._trial = optuna.trial.Trial(study, frozen._trial_id)
        return self._trial

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = trainer.callback_metrics
        metrics["model/params"] = torch.tensor(float(_parameters(pl_module)))
        if trainer.sanity_checking or self.monitor is None or self.pruned_at_step is not None:
            return
        step = trainer.global_step
        prune = False
        if trainer.is_global_zero and metrics.get(self.monitor) is not None:
            value = float(metrics[self.monitor])
            trial = self._optuna_trial()
            trial.report(value, step)
            prune = self.pruner is not None and trial.should_prune()
            if prune:
                trial.set_user_attr(PRUNED_AT_STEP, step)
                log.info(
                    "Optuna trial %d pruned at step %d (%s=%.4f): training stops here",
                    self.trial_number, step, self.monitor, value,
                )  # fmt: skip
        if self.pruner is not None and trainer.world_size > 1:
            prune = bool(trainer.strategy.broadcast(prune, src=0))
        if prune:
            self.pruned_at_step = step
            trainer.should_stop = True
            # now, not at the end of the epoch: `trainer.min_epochs` (1 by default) or `min_steps` would
            # keep a trial pruned in its first epoch training to that epoch's end, the steps pruning saves
            trainer.fit_loop.min_epochs = 0
            trainer.fit_loop.epoch_loop.min_steps = 0
            metrics["optuna/pruned"] = torch.tensor(1.0)
            metrics["optuna/pruned_at_step"] = torch.tensor(float(step))


def _parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
