"""The Optuna sweeper's checks without training anything: the params grammar against hand-written
distributions, and every bad `hydra.sweeper` value refused with one message naming the key, before the
storage is opened (an existing study is left exactly as it was)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

# the Optuna sweeper is an extra (`aiayn[sweep]`): a GPU image without it still runs `pytest -m gpu`
optuna = pytest.importorskip("optuna")
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution  # noqa: E402

from hydra_plugins.aiayn_optuna_sweeper._space import SweepConfigError, parse_space  # noqa: E402
from hydra_plugins.aiayn_optuna_sweeper._study import open_study, read_settings  # noqa: E402

GRAMMAR = [
    ("choice(64, 128, 192)", CategoricalDistribution([64, 128, 192])),
    ("choice(adam, sgd)", CategoricalDistribution(["adam", "sgd"])),
    ("choice(true, false)", CategoricalDistribution([True, False])),
    ("1,2,3", CategoricalDistribution([1, 2, 3])),  # the short form of choice
    ("range(1, 5)", IntDistribution(1, 5)),  # stop included, as in hydra-optuna-sweeper
    ("range(2, 10, 2)", IntDistribution(2, 10, step=2)),
    ("range(0.0, 1.0, 0.25)", FloatDistribution(0.0, 1.0, step=0.25)),
    ("shuffle(range(1, 4))", CategoricalDistribution([1, 2, 3])),
    ("interval(0.0, 0.3)", FloatDistribution(0.0, 0.3)),
    ("interval(0, 1)", FloatDistribution(0.0, 1.0)),  # Hydra reads an interval's bounds as floats
    ("int(interval(50, 600))", IntDistribution(50, 600)),
    ("tag(log, interval(5e-4, 5e-3))", FloatDistribution(5e-4, 5e-3, log=True)),
    ("tag(log, int(interval(1, 64)))", IntDistribution(1, 64, log=True)),
]


@pytest.mark.parametrize(("value", "expected"), GRAMMAR, ids=[v for v, _ in GRAMMAR])
def test_each_form_of_the_grammar_is_its_distribution(value: str, expected: object) -> None:
    space = parse_space({"model.x": value}, [])
    assert space.distributions == {"model.x": expected} and not space.fixed


def test_the_command_line_replaces_the_config_and_fixed_values_go_to_every_trial() -> None:
    params = {"a": "choice(1, 2)", "b": 5, "c": "interval(0, 1)"}
    space = parse_space(params, ["a=3", "c=tag(log, interval(1e-4, 1e-2))", "+d=choice(x, 'y z')", "e=f"])
    assert space.distributions == {
        "c": FloatDistribution(1e-4, 1e-2, log=True),
        "d": CategoricalDistribution(["x", "y z"]),
    }
    assert space.fixed == {"b": "b=5", "a": "a=3", "e": "e=f"}
    # the trial's overrides: fixed ones, then the sampled values as the grammar reads them back
    assert space.overrides({"c": 0.001, "d": "y z"}) == ["b=5", "a=3", "e=f", "c=0.001", "+d='y z'"]


BAD_PARAMS = [
    ("choice()", "hydra.sweeper.params.x: Error parsing override 'x=choice()'"),
    ("interval(2, 1)", "hydra.sweeper.params.x: interval(2.0, 1.0) is empty or inverted"),
    ("interval(1, 1)", "hydra.sweeper.params.x: interval(1.0, 1.0) is empty or inverted"),
    ("range(3, 3)", "hydra.sweeper.params.x: range(3, 3) is empty or inverted"),
    ("range(5, 1)", "hydra.sweeper.params.x: range(5, 1) is empty or inverted"),
    ("tag(log, interval(0, 1))", "hydra.sweeper.params.x: tag(log, interval(0.0, 1.0)) needs low > 0"),
    ("tag(log, range(1, 4))", "hydra.sweeper.params.x: tag(log, ...) applies to interval(...) only"),
    ("interval(1, 2", "hydra.sweeper.params.x: no viable alternative"),
]


@pytest.mark.parametrize(("value", "message"), BAD_PARAMS, ids=[v for v, _ in BAD_PARAMS])
def test_bad_params_name_the_key(value: str, message: str) -> None:
    with pytest.raises(SweepConfigError) as err:
        parse_space({"x": value}, [])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def _sweeper(tmp_path: Path, **changes: object) -> dict:
    sweeper = {
        "direction": "maximize",
        "storage": f"sqlite:///{tmp_path / 'optuna.db'}",
        "study_name": "s",
        "n_trials": 2,
        "n_jobs": 1,
        "max_failure_rate": 0.0,
        "params": {"lr": "tag(log, interval(1e-4, 1e-2))", "d": "choice(32, 64)"},
        "sampler": {"_target_": "optuna.samplers.TPESampler", "seed": 1},
        "pruner": None,
    }
    return {**sweeper, **changes}


CONFIG = OmegaConf.create({"optimized_metric": "val/bleu_best"})
TWO = OmegaConf.create({"optimized_metric": ["val/bleu_best", "model/params"]})
MEDIAN = {"_target_": "optuna.pruners.MedianPruner"}
BAD_SETTINGS = [
    ({"sampler": {"_target_": "optuna.samplers.NoSuchSampler"}}, CONFIG, "hydra.sweeper.sampler._target_="),
    ({"sampler": {"_target_": "collections.OrderedDict"}}, CONFIG, "hydra.sweeper.sampler._target_="),
    ({"pruner": {"_target_": "optuna.pruners.Nope"}}, CONFIG, "hydra.sweeper.pruner._target_=optuna.pru"),
    ({"pruner": {"_target_": "optuna.pruners.MedianPruner", "n_startup": 1}}, CONFIG, "hydra.sweeper.pruner"),
    ({"pruner": MEDIAN, "direction": ["maximize", "minimize"]}, TWO, "hydra.sweeper.pruner: Optuna cannot"),
    ({"pruner": MEDIAN, "storage": None}, CONFIG, "hydra.sweeper.pruner: pruning needs hydra.sweeper"),
    ({"direction": ["maximize", "minimize"]}, CONFIG, "hydra.sweeper.direction: 2 direction(s)"),
    ({"direction": "up"}, CONFIG, "hydra.sweeper.direction: expected minimize, maximize"),
    ({"n_trials": 0}, CONFIG, "hydra.sweeper.n_trials: expected a number >= 1"),
    ({"storage": "notaurl://x"}, CONFIG, "hydra.sweeper.storage=notaurl://x: expected a database URL"),
    ({"storage": "optuna.db"}, CONFIG, "hydra.sweeper.storage=optuna.db: expected a database URL"),
    ({"storage": "redis://localhost"}, CONFIG, "hydra.sweeper.storage=redis://localhost: expected a"),
    ({"storage": "sqlite+pysqlcipher://:pw@/x.db"}, CONFIG,
     "hydra.sweeper.storage=sqlite+pysqlcipher://:***@/x.db: the database driver of sqlite+pysqlcipher"),
    ({"sampler": {"_target_": "optuna.samplers.GridSampler", "search_space": None},
      "params": {"lr": "interval(0.1, 1)"}}, CONFIG, "hydra.sweeper.params.lr: the grid sampler needs"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "config", "message"), BAD_SETTINGS)
def test_bad_settings_name_the_key_and_create_no_storage(tmp_path: Path, changes, config, message) -> None:
    with pytest.raises(SweepConfigError) as err:
        read_settings(_sweeper(tmp_path, **changes), config, [])
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "optuna.db").exists()


def test_a_study_of_other_parameters_or_directions_is_refused_untouched(tmp_path: Path) -> None:
    settings = read_settings(_sweeper(tmp_path), CONFIG, [])
    study = open_study(settings)
    trial = study.ask(settings.space.distributions)
    study.tell(trial, 1.0)
    before = (tmp_path / "optuna.db").read_bytes()
    for changes, message in [
        ({"direction": "minimize"}, "has direction ['maximize'], this sweep ['minimize']"),
        ({"params": {"lr": "tag(log, interval(1e-4, 1e-1))", "d": "choice(32, 64)"}}, "searched other param"),
        ({"params": {"lr": "tag(log, interval(1e-4, 1e-2))"}}, "searched other parameters"),
    ]:
        with pytest.raises(SweepConfigError) as err:
            open_study(read_settings(_sweeper(tmp_path, **changes), CONFIG, []))
        assert str(err.value).startswith(
            "hydra.sweeper.study_name=s: the study in sqlite:///"
        ) and message in str(err.value)
    assert (tmp_path / "optuna.db").read_bytes() == before
    # the same space continues the study, the sampler's seed offset by the trials so far
    resumed = open_study(read_settings(_sweeper(tmp_path), CONFIG, []))
    assert len(resumed.trials) == 1 and resumed.sampler._rng.rng.randint(1 << 30) == (
        optuna.samplers.TPESampler(seed=2)._rng.rng.randint(1 << 30)
    )


@pytest.mark.parametrize(
    "sampler",
    [
        "TPESampler",
        "RandomSampler",
        "CmaEsSampler",
        "GridSampler",
        "QMCSampler",
        "GPSampler",
        "NSGAIISampler",
    ],
)
def test_every_sampler_of_the_issue_builds_with_a_seed(tmp_path: Path, sampler: str) -> None:
    params = {"lr": "choice(0.1, 0.2)", "d": "range(32, 64, 32)"}
    changes = {"sampler": {"_target_": f"optuna.samplers.{sampler}", "seed": 3}, "params": params}
    study = open_study(read_settings(_sweeper(tmp_path, **changes), CONFIG, []))
    assert type(study.sampler).__name__ == sampler
    trial = study.ask(parse_space(params, []).distributions)
    assert trial.params["lr"] in (0.1, 0.2) and trial.params["d"] in (32, 64)
