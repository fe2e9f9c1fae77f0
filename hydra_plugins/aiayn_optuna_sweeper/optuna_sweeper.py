"""The Hydra plugin class: Hydra instantiates it from `hydra.sweeper` (config.py) and calls `setup`, then
`sweep` with the command line's overrides. Optuna is imported only when a sweep runs (`_study`)."""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class AiaynOptunaSweeper(Sweeper):
    """An Optuna study driven by ask-and-tell: each batch of `n_jobs` trials is asked from the study, run
    through Hydra's launcher (basic, joblib, submitit), and told its result (value, PRUNED or FAIL)."""

    def __init__(self, **settings: Any) -> None:
        # the `hydra.sweeper` keys as plain values (checked when the sweep starts)
        self.settings = {
            key: OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
            for key, value in settings.items()
        }
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: list[str]) -> Any:
        from hydra_plugins.aiayn_optuna_sweeper._study import run_sweep

        assert self.config is not None and self.launcher is not None
        return run_sweep(self, arguments)
