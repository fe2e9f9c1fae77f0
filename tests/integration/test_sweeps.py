"""Sweeps through the real command line (slow): an Optuna search that writes its SQLite study and
resumes it, failed trials (exception, NaN loss) that do not stop the search, a 2x2 grid turned into a
report. Composition only (fast): every hparams_search config, `experiment=glob(*)`, the launchers."""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, IntLogUniformDistribution, IntUniformDistribution

from tests.conftest import REPO_ROOT
from tests.integration.test_train import TINY, _cli
from transformer.evaluation.sweep_report import write_report

CONFIGS = REPO_ROOT / "configs"
SEARCHES = sorted(p.stem for p in (CONFIGS / "hparams_search").glob("*.yaml"))
INT_DISTRIBUTIONS = (IntUniformDistribution, IntLogUniformDistribution)
NO_NETWORK = {"WANDB_MODE": "offline", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_SILENT": "true"}


def _tiny(*replace: str) -> list[str]:
    """test_train's TINY run, one epoch, with the keys given in `replace` set (or swept) there."""
    replace = ("trainer.max_epochs=1", *replace)
    keys = {r.split("=", 1)[0] for r in replace}
    return [o for o in TINY if o.split("=", 1)[0] not in keys] + list(replace)


def _job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml"))


def _overrides(job_dir: Path) -> dict[str, str]:
    return dict(o.split("=", 1) for o in yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()))


def _trials(sweep_dir: Path, study_name: str) -> list[optuna.trial.FrozenTrial]:
    storage = f"sqlite:///{sweep_dir / 'optuna.db'}"
    return optuna.load_study(study_name=study_name, storage=storage).trials


def _compose(overrides: list[str]):
    os.environ.setdefault("PROJECT_ROOT", str(REPO_ROOT))
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIGS)):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # so that `${hydra:...}` resolves
    return cfg


@pytest.fixture
def fresh_hydra():
    yield
    GlobalHydra.instance().clear()


# --- end to end (slow) --------------------------------------------------------------------------------


@pytest.mark.slow
def test_optuna_search_writes_its_study_and_resumes_it(tmp_path: Path) -> None:
    args = ["hparams_search=quickstart_optuna", "hydra.sweeper.n_trials=3", *_tiny()]
    args.append(f"paths.log_dir={tmp_path / 'logs'}")
    first = _cli(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    sweep_dir = tmp_path / "logs" / "train" / "sweeps" / "quickstart_optuna"
    assert (sweep_dir / "optuna.db").is_file()
    trials = _trials(sweep_dir, "quickstart_optuna")
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    # TINY fixes size, lr and warmup: what is left of the search space is searched
    assert set(trials[0].params) == {"model.config.dropout", "model.label_smoothing"}
    jobs = _job_dirs(sweep_dir)
    assert len(jobs) == 3 and len({j.name.rsplit("_", 1)[0] for j in jobs}) == 1  # one start time
    objective = {}
    for job in jobs:
        metrics = json.loads((job / "metrics.json").read_text())
        objective[float(_overrides(job)["model.config.dropout"])] = metrics["val/bleu_best"]
    assert {t.params["model.config.dropout"]: t.value for t in trials} == pytest.approx(objective)
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["name"] == "optuna" and results["best_value"] == pytest.approx(max(objective.values()))
    before = {job.name: (job / "metrics.json").read_text() for job in jobs}

    second = _cli(args, cwd=tmp_path)  # the same command again
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Resuming Optuna study 'quickstart_optuna' (3 trials so far)" in second.stdout + second.stderr
    trials = _trials(sweep_dir, "quickstart_optuna")
    assert len(trials) == 6 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    old, new = ({t.params["model.config.dropout"] for t in ts} for ts in (trials[:3], trials[3:]))
    assert not old & new  # the resumed run draws new trials (sampler seed offset by the trials so far)
    jobs = _job_dirs(sweep_dir)
    assert len(jobs) == 6
    assert {job.name: (job / "metrics.json").read_text() for job in jobs if job.name in before} == before
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(max(t.value for t in trials))


@pytest.mark.slow
def test_failed_trials_are_recorded_and_the_search_goes_on(tmp_path: Path) -> None:
    """A random sampler (seed 0) draws (lr 1e30, 2 heads): NaN loss, (1e30, 3 heads): d_model 32 not
    divisible, then (3e-3, 2 heads): a good trial. Every trial that trains is its own wandb run."""
    args = [
        "-m",  # sweep syntax on the command line needs it
        "hparams_search=optuna",
        "hydra/sweeper/sampler=random",
        "hydra.sweeper.sampler.seed=0",
        "hydra.sweeper.n_trials=3",
        *_tiny("model.optimizer.lr=choice(0.003,1e30)", "model.config.n_heads=choice(2,3)"),
        "logger=[csv,wandb]",
        f"paths.log_dir={tmp_path / 'logs'}",
    ]
    done = _cli(args, cwd=tmp_path, **NO_NETWORK)
    assert done.returncode == 0, done.stderr[-3000:]
    sweep_dir = tmp_path / "logs" / "train" / "sweeps" / "quickstart"  # study name: the experiment
    trials = _trials(sweep_dir, "quickstart")
    drawn = [(t.params["model.optimizer.lr"], t.params["model.config.n_heads"]) for t in trials]
    if not ({(1e30, 2), (0.003, 2)} <= set(drawn) and any(h == 3 for _, h in drawn)):
        pytest.fail(f"the random sampler (seed 0) drew {drawn}: pick a seed that draws every case")
    for trial, (lr, heads) in zip(trials, drawn):
        failed = lr == 1e30 or heads == 3
        assert trial.state == (optuna.trial.TrialState.FAIL if failed else optuna.trial.TrialState.COMPLETE)
    assert trials[-1].state == optuna.trial.TrialState.COMPLETE  # the search went on after the failures
    assert "Failed experiment: training loss is nan" in done.stderr + done.stdout

    by_params = {}
    for job in _job_dirs(sweep_dir):
        o = _overrides(job)
        by_params[(float(o["model.optimizer.lr"]), int(o["model.config.n_heads"]))] = job
    nan_job, good_job = by_params[(1e30, 2)], by_params[(0.003, 2)]
    assert not (nan_job / "metrics.json").exists() and (good_job / "metrics.json").is_file()
    assert "training loss is nan at optimizer step" in (nan_job / "train.log").read_text()
    bad_heads = next(job for (_, heads), job in by_params.items() if heads == 3)
    assert "must be divisible by n_heads" in (bad_heads / "train.log").read_text()
    # each trial that trained is its own offline wandb run, grouped under the sweep's name
    from wandb.proto import wandb_internal_pb2

    group = wandb_internal_pb2.RunRecord(run_group="quickstart").SerializeToString()
    for job in (nan_job, good_job):
        (run_file,) = job.glob("wandb/offline-run-*/run-*.wandb")
        assert group in run_file.read_bytes(), job
    # the report lists the failed jobs without metrics
    rows = list(csv.DictReader(write_report(sweep_dir)["jobs_csv"].open()))
    n_failed = sum(t.state == optuna.trial.TrialState.FAIL for t in trials)
    assert [r["status"] for r in rows].count("failed") == n_failed
    assert all(r["val/bleu_best"] == "" for r in rows if r["status"] == "failed")


@pytest.mark.slow
def test_a_search_where_every_trial_fails_ends_in_one_line(tmp_path: Path) -> None:
    """d_model 30 is divisible by no head count of the search: both trials fail, each recorded as FAIL with
    its one-line error, and the sweep ends with status 1 and one `error:` line naming the logs (Optuna's
    `study.best_trial` would raise `ValueError: Record does not exist.`)."""
    args = ["-m", "hparams_search=quickstart_optuna", "hydra.sweeper.n_trials=2"]
    args += [
        *_tiny("model.config.d_model=30", "model.config.n_heads=4"),
        f"paths.log_dir={tmp_path / 'logs'}",
    ]
    done = _cli(args, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "Traceback" not in output and "Record does not exist" not in output
    sweep_dir = tmp_path / "logs" / "train" / "sweeps" / "quickstart_optuna"
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: every job of the sweep failed (2 of 2)"), errors
    assert "d_model (30) must be divisible by n_heads" in errors[0] and str(sweep_dir) in errors[0]
    assert [t.state for t in _trials(sweep_dir, "quickstart_optuna")] == [optuna.trial.TrialState.FAIL] * 2
    assert output.count("Failed experiment: cannot build `model`") == 2
    assert len(list(sweep_dir.glob("*/train.log"))) == 2


@pytest.mark.slow
def test_a_grid_of_short_runs_succeeds_and_a_failed_job_ends_it_in_one_line(tmp_path: Path) -> None:
    """Hydra's grid needs no objective: jobs that end before their first validation succeed. A job that
    fails (d_model 30) does not stop the others; the sweep then ends with status 1 and one line."""
    short = [*_tiny("model.config.n_heads=4"), "trainer.max_steps=2", "test=false"]
    short.append(f"paths.log_dir={tmp_path / 'logs'}")
    done = _cli(["-m", "seed=1,2", *short], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout + done.stderr).count("No validation ran before training ended at step 2") == 2

    done = _cli(["-m", "model.config.d_model=30,32", *[o for o in short if "d_model" not in o]], cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output, output[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: 1 of the sweep's 2 jobs failed; job 0 ("), errors
    assert "d_model (30) must be divisible by n_heads" in errors[0]
    grid = max((tmp_path / "logs" / "train" / "multiruns").iterdir())  # the second sweep
    assert not (grid / "0" / "metrics.json").exists() and (grid / "1" / "metrics.json").is_file()


@pytest.mark.slow
def test_grid_of_two_by_two_and_its_report(tmp_path: Path) -> None:
    args = ["-m", *_tiny("model.config.d_model=16,32", "seed=1,2"), f"paths.log_dir={tmp_path / 'logs'}"]
    done = _cli(args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    jobs = _job_dirs(sweep_dir)
    assert [j.name for j in jobs] == ["0", "1", "2", "3"]
    scores = {}
    for job in jobs:
        o = _overrides(job)
        scores[(int(o["model.config.d_model"]), int(o["seed"]))] = json.loads(
            (job / "metrics.json").read_text()
        )["val/bleu_best"]

    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer.evaluation.sweep_report",
            str(sweep_dir),
            "--out",
            str(tmp_path / "report"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr[-3000:]
    out = tmp_path / "report"
    written = {Path(line).name for line in report.stdout.split()}
    assert written == {"jobs.csv", "summary.csv", "report.md", "val_bleu_best_vs_params.png"}
    rows = list(csv.DictReader((out / "jobs.csv").open()))
    assert len(rows) == 4 and all(r["status"] == "done" for r in rows)
    for row in rows:
        key = (int(row["model.config.d_model"]), int(row["seed"]))
        assert float(row["val/bleu_best"]) == pytest.approx(scores[key])
    summary = {int(r["model.config.d_model"]): r for r in csv.DictReader((out / "summary.csv").open())}
    assert set(summary) == {16, 32}
    for d_model, row in summary.items():
        values = [scores[(d_model, seed)] for seed in (1, 2)]
        assert row["jobs"] == "2" and row["finished"] == "2"
        assert float(row["val/bleu_best mean"]) == pytest.approx(statistics.fmean(values))
        assert float(row["val/bleu_best std"]) == pytest.approx(statistics.stdev(values))
    markdown = (out / "report.md").read_text()
    assert "Mean ± std over `seed`" in markdown and "![" in markdown
    assert (out / "val_bleu_best_vs_params.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- composition (fast) -------------------------------------------------------------------------------


@pytest.mark.parametrize("search", SEARCHES)
def test_every_search_composes_into_a_valid_optuna_sweep(fresh_hydra, tmp_path: Path, search: str) -> None:
    cfg = _compose([f"hparams_search={search}", f"paths.log_dir={tmp_path}"])
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "maximize"
    sweep_dir = Path(cfg.hydra.sweep.dir)
    assert sweep_dir == tmp_path / "train" / "sweeps" / sweeper.study_name  # no timestamp: resumable
    assert sweeper.storage == f"sqlite:///{sweep_dir}/optuna.db"
    assert sweeper.max_failure_rate == 1.0 and cfg.hydra.mode.name == "MULTIRUN"
    assert "${now:" in OmegaConf.to_container(cfg.hydra.sweep)["subdir"]
    assert [c._target_ for c in cfg.hydra.callbacks.values()] == [
        "transformer.cli.sweep_callbacks.ResumeOptunaStudy"
    ]
    assert cfg.callbacks.non_finite_loss.action == "stop"  # a diverged trial fails, not scored
    params = [f"{k}={v}" for k, v in (sweeper.params or {}).items()]
    distributions, fixed = create_params_from_overrides(params)  # the sweeper's own parser
    assert not fixed
    for key, distribution in distributions.items():  # keys exist, values keep the config's type
        default = OmegaConf.select(cfg, key)
        assert default is not None, key
        if isinstance(distribution, CategoricalDistribution):
            assert all(type(c) is type(default) for c in distribution.choices), key
        else:  # int(interval(...)) for integers: a plain interval draws floats
            assert isinstance(distribution, INT_DISTRIBUTIONS) == isinstance(default, int), key
    if search == "optuna":  # the generic search: the command line brings the space
        assert not distributions and sweeper.study_name == cfg.hydra.runtime.choices.experiment
        return
    assert {"model.optimizer.lr", "model.scheduler.warmup_steps", "model.config.dropout"} <= set(
        distributions
    )
    assert {"model.label_smoothing", "model.config.d_model", "model.config.n_encoder_layers"} <= set(
        distributions
    )
    experiment = cfg.hydra.runtime.choices.experiment
    assert search.removesuffix("_optuna") in experiment
    assert cfg.optimized_metric == {"sst2": "val/acc_best"}.get(experiment, "val/bleu_best")
    # no trial fails by construction: every width is divisible by the number of heads
    assert all(d % cfg.model.config.n_heads == 0 for d in distributions["model.config.d_model"].choices)
    assert cfg.hydra.sweeper.sampler.seed == cfg.seed


def test_glob_over_experiments_expands_to_one_composable_job_each(fresh_hydra) -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser

    # what `python train.py -m 'experiment=glob(*)' seed=1,2` launches, without training anything
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONFIGS)))
    parser = OverridesParser.create(config_loader=loader)
    (batch,) = BasicSweeper.split_arguments(parser.parse_overrides(["experiment=glob(*)", "seed=1,2"]), None)
    experiments = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
    assert sorted(job[0] for job in batch[::2]) == [f"experiment={e}" for e in experiments]
    assert len(batch) == 2 * len(experiments)
    for job in batch[::2]:
        cfg = _compose(job)
        assert cfg.hydra.runtime.choices.experiment == job[0].split("=")[1] and cfg.seed == 1


def test_slurm_launcher_sizes_a_multi_node_ddp_job(fresh_hydra, tmp_path: Path, monkeypatch) -> None:
    import hydra.utils
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

    overrides = ["hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=2", "trainer.devices=8"]
    cfg = _compose([*overrides, "hydra.launcher.partition=gpu", f"paths.log_dir={tmp_path}"])
    launcher = hydra.utils.instantiate(cfg.hydra.launcher)
    assert isinstance(launcher, SlurmLauncher)
    params = launcher.params
    assert (params["nodes"], params["tasks_per_node"], params["gpus_per_node"]) == (2, 8, 8)
    # the sbatch script submitit would submit (the parameter mapping of the launcher's launch())
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit only checks that srun exists
    (tmp_path / "srun").chmod(0o755)
    executor = submitit.AutoExecutor(cluster="slurm", folder=tmp_path / "submitit", slurm_max_num_timeout=0)
    generic = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{
            k if k in generic else f"slurm_{k}": v
            for k, v in params.items()
            if k not in ("submitit_folder", "max_num_timeout")
        }
    )
    sbatch = executor._executor._make_submission_file_text("python -m submitit.core._submit x", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--time=1440"):
        assert f"#SBATCH {line}" in sbatch, line
    assert "\nsrun " in sbatch  # one task per GPU, each one Lightning DDP process

    single = _compose(["hydra/launcher=slurm", f"paths.log_dir={tmp_path}"])  # trainer default: 1 GPU
    assert hydra.utils.instantiate(single.hydra.launcher).params["tasks_per_node"] == 1
    local = _compose(["hydra/launcher=local", f"paths.log_dir={tmp_path}"])
    assert isinstance(hydra.utils.instantiate(local.hydra.launcher), LocalLauncher)
