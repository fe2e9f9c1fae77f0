"""transformer.cli.sweeps.SweepJobs: the jobs of one command's sweep and the one line a failed sweep ends
with. One object per command: a process that runs several commands (the README driver, a notebook)
never reports an earlier command's jobs."""

from __future__ import annotations

from pathlib import Path

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
