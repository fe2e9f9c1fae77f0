"""Sweeps through the real command line (slow): an Optuna search that writes its SQLite study and
resumes it, failed trials (exception, NaN loss) that do not stop the search, a 2x2 grid turned into a
report. Composition only (fast): every hparams_search config, `experiment=glob(*)`, the launchers."""

from __future__ import annotations

import csv
import json
import os
import signal
import statistics
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from tests.helpers import forkserver
from tests.helpers.cli import TINY, run_script
from tests.helpers.repo import REPO_ROOT, cli_env
from transformer.evaluation.sweep_report import write_report

# the Optuna sweeper is an extra (`aiayn[sweep]`): a GPU image without it still runs `pytest -m gpu`
optuna = pytest.importorskip("optuna")
from optuna.distributions import CategoricalDistribution, IntDistribution  # noqa: E402

from hydra_plugins.aiayn_optuna_sweeper._space import parse_space  # noqa: E402

CONFIGS = REPO_ROOT / "configs"
SEARCHES = sorted(p.stem for p in (CONFIGS / "hparams_search").glob("*.yaml"))
NO_NETWORK = {"WANDB_MODE": "offline", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_SILENT": "true"}


def _tiny(*replace: str) -> list[str]:
    """The TINY run, one epoch, with the keys given in `replace` set (or swept) there."""
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


def _wait_for(sweep_dir: Path, study_name: str, ready, job: Future, timeout: float = 300) -> None:
    """Poll the study until `ready(trials)` (the sweep runs in `job`). The database is read only once a
    job has started: opening it while the sweeper is still creating its tables races with it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job.done():
            done = job.result()
            pytest.fail(f"the sweep ended (exit {done.returncode}) first:\n{done.stderr[-3000:]}")
        if _job_dirs(sweep_dir):
            try:
                if ready(_trials(sweep_dir, study_name)):
                    return
            except KeyError:  # the study is not created yet
                pass
        time.sleep(0.5)
    pytest.fail("the sweep did not get there in time")


@pytest.mark.slow
def test_a_pruned_search_interrupted_by_ctrl_c_continues_and_reports(tmp_path: Path) -> None:
    """Quickstart trials (TPE: its first 10 are random), lr 3e-3 or 1e-6, MedianPruner after one trial: a
    trial worse than the median at a validation stops there (PRUNED, its run directory complete,
    its job exits normally). Ctrl-C in the middle leaves no RUNNING trial; the same command continues the
    study with new trials; the report marks the pruned ones."""
    args = [
        "-m",
        "hparams_search=quickstart_optuna",
        "hydra.sweeper.n_trials=4",
        "hydra/sweeper/pruner=median",
        "hydra.sweeper.pruner.n_startup_trials=1",
        # no sanity check (TINY): that no report comes from it is test_optuna_trial's, with the default
        # trainer's num_sanity_val_steps and a metric the sanity check does log
        *_tiny("trainer.max_epochs=3", "model.optimizer.lr=choice(0.003,1e-6)"),
        f"paths.log_dir={tmp_path / 'logs'}",
    ]
    sweep_dir = tmp_path / "logs" / "train" / "sweeps" / "quickstart_optuna"
    with forkserver.in_a_thread(run_script, "train.py", args, cwd=tmp_path, timeout=600) as (pid, job):
        running = optuna.trial.TrialState.RUNNING
        _wait_for(sweep_dir, "quickstart_optuna", lambda ts: len(ts) >= 2 and ts[-1].state == running, job)
        os.kill(pid, signal.SIGINT)  # Ctrl-C during the second trial
        stopped = job.result(timeout=300)
    assert stopped.returncode != 0, stopped.stderr[-3000:]
    interrupted = _trials(sweep_dir, "quickstart_optuna")
    # the interrupted trial FAILs, or, where its Ctrl-C landed in a library callback that dropped it and
    # the job ran to its end, holds that job's own outcome; never RUNNING
    assert running not in {t.state for t in interrupted}

    done = run_script("train.py", args, cwd=tmp_path)  # the same command again
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        f"Resuming Optuna study 'quickstart_optuna' ({len(interrupted)} trials so far)"
        in done.stdout + done.stderr
    )
    trials = _trials(sweep_dir, "quickstart_optuna")
    assert trials[: len(interrupted)] == interrupted and len(trials) == len(interrupted) + 4
    states = {t.number: t.state for t in trials}
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    if not pruned or optuna.trial.TrialState.COMPLETE not in states.values():
        pytest.fail(f"the random sampler drew {[t.params for t in trials]} ({states}): pick a seed with both")
    by_trial = {}
    for job in _job_dirs(sweep_dir):
        if (job / "config.yaml").is_file():
            callback = yaml.safe_load((job / "config.yaml").read_text())["callbacks"]["optuna_trial"]
            by_trial[int(callback["trial_number"])] = job
    for trial in pruned:  # a complete run directory, stopped at the step the study recorded
        job = by_trial[trial.number]
        metrics = json.loads((job / "metrics.json").read_text())
        step = trial.user_attrs["pruned_at_step"]
        assert metrics["optuna/pruned"] == 1.0 and metrics["optuna/pruned_at_step"] == step
        assert step == max(trial.intermediate_values) and metrics["global_step"] < 3 * 20
        assert (job / "checkpoints" / "last.ckpt").is_file() and list(job.glob("checkpoints/epoch_*.ckpt"))
        assert f"Optuna trial {trial.number} pruned at step {step}" in (job / "train.log").read_text()
    for trial in trials:
        if trial.state == optuna.trial.TrialState.COMPLETE:  # reported after every validation (3 epochs)
            assert len(trial.intermediate_values) == 3
            assert trial.value == pytest.approx(max(trial.intermediate_values.values()))
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best = max(t.value for t in trials if t.state == optuna.trial.TrialState.COMPLETE)
    assert results["best_value"] == pytest.approx(best) and results["this_run"]["pruned"] >= 1

    rows = list(csv.DictReader(write_report(sweep_dir)["jobs_csv"].open()))
    marked = {int(r["pruned_at_step"]) for r in rows if r["status"] == "pruned"}
    assert marked == {t.user_attrs["pruned_at_step"] for t in pruned} or len(marked) <= len(pruned)
    assert sum(r["status"] == "pruned" for r in rows) == len(pruned)
    assert "pruned at step" in (sweep_dir / "report.md").read_text()


@pytest.mark.slow
def test_a_two_objective_search_and_its_pareto_front(tmp_path: Path) -> None:
    """BLEU up, parameters down: a multi-objective study whose trials carry both values, and a report that
    draws and lists the Pareto front (the trials no other trial beats on both)."""
    args = [
        "-m",
        "hparams_search=quickstart_optuna",
        "hydra.sweeper.n_trials=3",
        "optimized_metric=[val/bleu_best,model/params]",
        "hydra.sweeper.direction=[maximize,minimize]",
        *_tiny("model.config.d_model=choice(16,32)", "model.config.d_ff=choice(32,64)"),
        f"paths.log_dir={tmp_path / 'logs'}",
    ]
    done = run_script("train.py", args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    sweep_dir = tmp_path / "logs" / "train" / "sweeps" / "quickstart_optuna"
    study = optuna.load_study(study_name="quickstart_optuna", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials) and len(study.trials) == 3
    values = {}
    for job in _job_dirs(sweep_dir):
        metrics = json.loads((job / "metrics.json").read_text())
        values[job.name] = (metrics["val/bleu_best"], metrics["model/params"])
    assert sorted(tuple(t.values) for t in study.trials) == sorted(values.values())  # the same floats
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert sorted(t["number"] for t in results["best_trials"]) == sorted(t.number for t in study.best_trials)

    written = write_report(sweep_dir)
    assert written["pareto_plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    section = (sweep_dir / "report.md").read_text().split("## Pareto front")[1].split("## ")[0]
    front = {n for n, (b, p) in values.items() if not any(b2 >= b and p2 <= p and (b2, p2) != (b, p)
                                                             for b2, p2 in values.values())}  # fmt: skip
    assert {line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| 20")} == front

    # Optuna cannot prune it
    refused = run_script("train.py", [*args, "hydra/sweeper/pruner=median"], cwd=tmp_path)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    (line,) = [ln for ln in refused.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: hydra.sweeper.pruner: Optuna cannot prune a study with 2 objectives")
    assert len(study.trials) == len(
        optuna.load_study(study_name="quickstart_optuna", storage=study._storage).trials
    )


@pytest.mark.slow
def test_bad_sweep_input_is_one_line_and_leaves_the_study_alone(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "logs" / "train" / "sweeps" / "quickstart_optuna"
    sweep_dir.mkdir(parents=True)
    storage = f"sqlite:///{sweep_dir / 'optuna.db'}"
    study = optuna.create_study(study_name="quickstart_optuna", storage=storage, direction="maximize")
    study.enqueue_trial({"x": 1.0})
    study.optimize(lambda t: t.suggest_float("x", 0, 2), n_trials=1)
    before = (sweep_dir / "optuna.db").read_bytes()
    base = ["-m", "hparams_search=quickstart_optuna", *_tiny(), f"paths.log_dir={tmp_path / 'logs'}"]
    cases = [
        (["hydra.sweeper.sampler._target_=optuna.samplers.Nope"], "sampler._target_=optuna.samplers.Nope"),
        (["model.config.dropout=interval(0.3,0.1)"], "model.config.dropout: interval(0.3, 0.1) is empty"),
        ([], "hydra.sweeper.study_name=quickstart_optuna: the study in sqlite:///"),  # other parameters
        (["hydra.sweeper.direction=minimize"], "has direction ['maximize'], this sweep ['minimize']"),
        (["hydra.sweeper.storage=notaurl://x"], "hydra.sweeper.storage=notaurl://x: expected a database URL"),
    ]  # fmt: skip
    # each a real process: the first started as a user starts it (a fresh interpreter: what its imports
    # print counts toward the one line), the others forked from the warm interpreter
    # (tests/helpers/forkserver.py)
    for i, (extra, message) in enumerate(cases):
        done = run_script("train.py", [*base, *extra], cwd=tmp_path, timeout=600, fresh=i == 0)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 1 and "Traceback" not in done.stderr + done.stdout, done.stderr[-2000:]
        assert len(errors) == 1 and message in errors[0], (extra, errors)
        assert (sweep_dir / "optuna.db").read_bytes() == before, extra
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["optuna.db"]  # no job ran


@pytest.mark.slow
def test_failed_trials_are_recorded_and_the_search_goes_on(tmp_path: Path) -> None:
    """The grid sampler draws every case once: lr 1e30 (NaN loss), d_ff 4e12 (out of memory: the weights
    cannot be allocated), max_steps 2 (training ends before its first validation: no objective), and the
    one good trial. Each failure is a FAIL trial, the sweep goes on and ends with status 0. Every trial
    that trains is its own wandb run."""
    args = [
        "-m",  # sweep syntax on the command line needs it
        "hparams_search=optuna",
        "hydra/sweeper/sampler=grid",
        "hydra.sweeper.sampler.seed=0",
        "hydra.sweeper.n_trials=8",
        *_tiny(
            "model.optimizer.lr=choice(0.003,1e30)",
            "model.config.d_ff=choice(64,4000000000000)",
            "trainer.max_steps=choice(-1,2)",
        ),
        "logger=[csv,wandb]",
        f"paths.log_dir={tmp_path / 'logs'}",
    ]
    done = run_script("train.py", args, cwd=tmp_path, env=cli_env(**NO_NETWORK))
    assert done.returncode == 0, done.stderr[-3000:]
    sweep_dir = tmp_path / "logs" / "train" / "sweeps" / "quickstart"  # study name: the experiment
    trials = _trials(sweep_dir, "quickstart")
    keys = ("model.optimizer.lr", "model.config.d_ff", "trainer.max_steps")
    drawn = [tuple(t.params[k] for k in keys) for t in trials]
    assert sorted(drawn) == sorted((lr, ff, s) for lr in (0.003, 1e30) for ff in (64, 4e12) for s in (-1, 2))
    for trial, (lr, d_ff, max_steps) in zip(trials, drawn):
        good = (lr, d_ff, max_steps) == (0.003, 64, -1)
        assert trial.state == (optuna.trial.TrialState.COMPLETE if good else optuna.trial.TrialState.FAIL)
    output = done.stdout + done.stderr
    assert output.count("] Trial ") >= 8 and "failed" in output

    by_params = {tuple(_overrides(job)[k] for k in keys): job for job in _job_dirs(sweep_dir)}
    nan_job, good_job = by_params[("1e+30", "64", "-1")], by_params[("0.003", "64", "-1")]
    oom_job, short_job = by_params[("0.003", "4000000000000", "-1")], by_params[("0.003", "64", "2")]
    assert not (nan_job / "metrics.json").exists() and (good_job / "metrics.json").is_file()
    assert "training loss is nan at optimizer step" in (nan_job / "train.log").read_text()
    assert "can't allocate memory" in (oom_job / "train.log").read_text()
    assert "no validation ran before training ended at step 2" in (short_job / "train.log").read_text()
    # each trial that trained is its own offline wandb run, grouped under the sweep's name
    from wandb.proto import wandb_internal_pb2

    group = wandb_internal_pb2.RunRecord(run_group="quickstart").SerializeToString()
    for job in (nan_job, good_job):
        (run_file,) = job.glob("wandb/offline-run-*/run-*.wandb")
        assert group in run_file.read_bytes(), job
    # the report lists the failed jobs without metrics
    rows = list(csv.DictReader(write_report(sweep_dir)["jobs_csv"].open()))
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
    done = run_script("train.py", args, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "Traceback" not in output and "Record does not exist" not in output
    sweep_dir = tmp_path / "logs" / "train" / "sweeps" / "quickstart_optuna"
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: every job of the sweep failed (2 of 2)"), errors
    assert "d_model (30) must be divisible by n_heads" in errors[0] and str(sweep_dir) in errors[0]
    assert [t.state for t in _trials(sweep_dir, "quickstart_optuna")] == [optuna.trial.TrialState.FAIL] * 2
    assert output.count("failed: ConfigError: cannot build `model`") == 2
    assert len(list(sweep_dir.glob("*/train.log"))) == 2


@pytest.mark.slow
def test_a_grid_of_short_runs_succeeds_and_a_failed_job_ends_it_in_one_line(tmp_path: Path) -> None:
    """Hydra's grid needs no objective: jobs that end before their first validation succeed, here through
    `hydra/launcher=local` (submitit: each job pickled and run in a process of its own, its output in
    <sweep dir>/.submitit/<job id>/). A job that fails (d_model 30) does not stop the others; the sweep
    then ends with status 1 and one line."""
    short = [*_tiny("model.config.n_heads=4"), "trainer.max_steps=2", "test=false"]
    short.append(f"paths.log_dir={tmp_path / 'logs'}")
    done = run_script("train.py", ["-m", "hydra/launcher=local", "seed=1,2", *short], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (grid,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert [(job.name, _overrides(job)["seed"]) for job in _job_dirs(grid)] == [("0", "1"), ("1", "2")]
    for job in _job_dirs(grid):  # each job trained its 2 steps and wrote its run directory
        assert json.loads((job / "metrics.json").read_text())["global_step"] == 2, job
        assert (job / "checkpoints" / "last.ckpt").is_file(), job
        assert "No validation ran before training ended at step 2" in (job / "train.log").read_text(), job
    # submitit's local job id is the process id of the job: two processes, one seed each
    seeds = {}
    for out in grid.glob(".submitit/*/*_0_log.out"):
        job_id = out.parent.name
        assert f"Starting with JobEnvironment(job_id={job_id}," in out.read_text(), out
        seeds[job_id] = [
            ln for ln in out.with_suffix(".err").read_text().splitlines() if ln.startswith("Seed")
        ]
    assert sorted(seeds.values()) == [["Seed set to 1"], ["Seed set to 2"]], seeds

    done = run_script(
        "train.py",
        ["-m", "model.config.d_model=30,32", *[o for o in short if "d_model" not in o]],
        cwd=tmp_path,
    )
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
    done = run_script("train.py", args, cwd=tmp_path)
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

    out = tmp_path / "report"
    report = run_script("transformer.evaluation.sweep_report", [sweep_dir, "--out", out], timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
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
    assert sweeper._target_.endswith("AiaynOptunaSweeper") and sweeper.direction == "maximize"
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler" and sweeper.pruner is None
    sweep_dir = Path(cfg.hydra.sweep.dir)
    assert sweep_dir == tmp_path / "train" / "sweeps" / sweeper.study_name  # no timestamp: resumable
    assert sweeper.storage == f"sqlite:///{sweep_dir}/optuna.db"
    assert sweeper.max_failure_rate == 1.0 and cfg.hydra.mode.name == "MULTIRUN"
    assert "${now:" in OmegaConf.to_container(cfg.hydra.sweep)["subdir"]
    assert sorted(c._target_ for c in cfg.hydra.callbacks.values()) == [
        "transformer.cli.sweeps.ResumeOptunaStudy",
        "transformer.cli.sweeps.SweepEndLines",  # every sweep's (configs/hydra/default.yaml)
    ]
    assert cfg.callbacks.non_finite_loss.action == "stop"  # a diverged trial fails, not scored
    space = parse_space(OmegaConf.to_container(sweeper.params) if sweeper.params else None, [])
    distributions = space.distributions  # the sweeper's own parser
    assert not space.fixed
    for key, distribution in distributions.items():  # keys exist, values keep the config's type
        default = OmegaConf.select(cfg, key)
        assert default is not None, key
        if isinstance(distribution, CategoricalDistribution):
            assert all(type(c) is type(default) for c in distribution.choices), key
        else:  # int(interval(...)) for integers: a plain interval draws floats
            assert isinstance(distribution, IntDistribution) == isinstance(default, int), key
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

    overrides = ["hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=2", "trainer.devices=8"]
    cfg = _compose([*overrides, "hydra.launcher.partition=gpu", f"paths.log_dir={tmp_path}"])
    # imported after the first composition: Hydra's plugin scan executes the plugin modules again, so a
    # class imported before it is not the class the launcher is made of
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

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
