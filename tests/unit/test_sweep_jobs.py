"""transformer.cli.sweeps.SweepJobs: the jobs of one command's sweep and the one line a failed sweep ends
with. One object per command: a process that runs several commands (the README driver, a notebook)
never reports an earlier command's jobs."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from transformer.cli.sweeps import SweepJob, SweepJobs


def _jobs(*errors: str | None) -> SweepJobs:
    jobs = SweepJobs()
    for num, error in enumerate(errors):
        job = SweepJob(num, [f"seed={num}"], Path(f"/sweep/{num}"))
        if error is not None:
            job.fail(error)
        jobs.append(job)
    return jobs


def test_the_first_failed_job_is_named_with_the_counts() -> None:
    line = _jobs(None, "bad lr", "nan loss").failure_summary(RuntimeError("stop"))
    assert (
        line == "2 of the sweep's 3 jobs failed; the first, job 1 (seed=1): bad lr; logs: /sweep/*/train.log"
    )
    line = _jobs("bad lr").failure_summary(RuntimeError("stop"))
    assert line == "every job of the sweep failed (1 of 1); job 0 (seed=0): bad lr; logs: /sweep/*/train.log"


def test_a_sweep_that_fails_outside_its_jobs_says_after_how_many() -> None:
    line = _jobs(None, None).failure_summary(KeyError("x"))
    assert line == "the sweep failed after 2 jobs: KeyError: 'x'"


def test_each_command_has_its_own_jobs() -> None:
    """An earlier command's failed sweep in the same process: a later single run's error is its own."""
    earlier, later = _jobs("bad lr"), SweepJobs()
    assert earlier.failure_summary(RuntimeError("stop")) is not None
    assert later.failure_summary(RuntimeError("a plain crash")) is None  # not a sweep: the usual traceback

    class UserFacing(Exception):
        user_facing = True

    assert later.failure_summary(UserFacing("error: bad value\nmore")) == "error: bad value"


def _hydra(sweep_dir: str, num: int) -> DictConfig:
    return OmegaConf.create(
        {
            "sweep": {"dir": sweep_dir},
            "job": {"num": num},
            "overrides": {"task": [f"seed={num}"]},
            "runtime": {"output_dir": f"{sweep_dir}/{num}"},
            "sweeper": {},
        }
    )


def test_each_job_is_a_wandb_run_grouped_under_the_sweep_unless_a_group_is_set() -> None:
    jobs = SweepJobs()
    grouped = OmegaConf.create({"logger": {"wandb": {"project": "p", "group": None}}})
    sweep = "/logs/multiruns/2026-11-28_10-00-00"
    job = jobs.start(grouped, _hydra(sweep, 0))
    assert grouped.logger.wandb.group == "2026-11-28_10-00-00"
    assert (job.num, job.overrides, job.output_dir) == (0, ["seed=0"], Path(sweep) / "0")
    own = OmegaConf.create({"logger": {"wandb": {"project": "p", "group": "my-study"}}})
    jobs.start(own, _hydra("/logs/multiruns/other", 1))
    assert own.logger.wandb.group == "my-study"  # the user's group stays
    without = OmegaConf.create({"logger": {"csv": {}}})
    jobs.start(without, _hydra("/logs/multiruns/other", 2))
    assert "wandb" not in without.logger and len(jobs) == 3
