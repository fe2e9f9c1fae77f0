"""The sweeper's configs in Hydra's ConfigStore: `hydra/sweeper=aiayn_optuna`, its samplers
(`hydra/sweeper/sampler=tpe|random|cmaes|grid|qmc|gp|nsgaii`) and pruners
(`hydra/sweeper/pruner=median|successive_halving|hyperband`; none unless chosen)."""

# no `from __future__ import annotations`: Hydra executes this module before it is in sys.modules,
# where dataclasses would look the string annotations up

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

SAMPLERS: dict[str, dict[str, Any]] = {
    "tpe": {"_target_": "optuna.samplers.TPESampler", "seed": None, "n_startup_trials": 10},
    "random": {"_target_": "optuna.samplers.RandomSampler", "seed": None},
    "cmaes": {"_target_": "optuna.samplers.CmaEsSampler", "seed": None, "n_startup_trials": 1},
    # search_space: null takes the grid from the params (choice and range values)
    "grid": {"_target_": "optuna.samplers.GridSampler", "seed": None, "search_space": None},
    "qmc": {"_target_": "optuna.samplers.QMCSampler", "seed": None, "qmc_type": "sobol", "scramble": True},
    "gp": {"_target_": "optuna.samplers.GPSampler", "seed": None, "n_startup_trials": 10},
    "nsgaii": {"_target_": "optuna.samplers.NSGAIISampler", "seed": None, "population_size": 50},
}

PRUNERS: dict[str, dict[str, Any]] = {
    # a trial stops when its value is worse than the median of earlier trials at the same step
    "median": {"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 5, "n_warmup_steps": 0},
    "successive_halving": {
        "_target_": "optuna.pruners.SuccessiveHalvingPruner",
        "min_resource": "auto",
        "reduction_factor": 4,
    },
    "hyperband": {
        "_target_": "optuna.pruners.HyperbandPruner",
        "min_resource": 1,
        "max_resource": "auto",
        "reduction_factor": 3,
    },
}


@dataclass
class AiaynOptunaSweeperConf:
    """`hydra.sweeper`: the keys of hydra-optuna-sweeper, and `pruner` (`Any` where a value may be null:
    OmegaConf reads no `X | None`)."""

    _target_: str = "hydra_plugins.aiayn_optuna_sweeper.optuna_sweeper.AiaynOptunaSweeper"
    _recursive_: bool = False  # the sweeper builds sampler and pruner itself (one error line each)
    defaults: Any = field(default_factory=lambda: ["_self_", {"sampler": "tpe"}, {"pruner": None}])
    sampler: Any = None
    # an optuna.pruners.* config (`_target_` and arguments), or null: no pruning
    pruner: Any = None
    # `minimize` or `maximize`, or a list of them (one per `optimized_metric`): a multi-objective study
    direction: Any = "minimize"
    # an SQLAlchemy URL (sqlite:///path/optuna.db); null: in memory, no resume and no pruning
    storage: Any = None
    study_name: Any = None
    n_trials: int = 20  # trials this run adds to the study
    n_jobs: int = 2  # trials launched at once (one batch for the launcher)
    # the sweep stops once more than this fraction of its finished trials failed
    max_failure_rate: float = 0.0
    # key: value in the grammar of hydra-optuna-sweeper (choice, range, interval, int(...), tag(log, ...))
    params: Any = None
    # set by the sweeper in each job's config: the number of the job's trial in the study
    trial_number: Any = None


def register() -> None:
    store = ConfigStore.instance()
    store.store(group="hydra/sweeper", name="aiayn_optuna", node=AiaynOptunaSweeperConf, provider="aiayn")
    for name, node in SAMPLERS.items():
        store.store(group="hydra/sweeper/sampler", name=name, node=node, provider="aiayn")
    for name, node in PRUNERS.items():
        store.store(group="hydra/sweeper/pruner", name=name, node=node, provider="aiayn")


register()
