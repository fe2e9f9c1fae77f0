"""tests/helpers/forkserver.py: commands fork from the warm server in every test, not only the one that
started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import forkserver
from tests.helpers.repo import REPO_ROOT, cli_env

HELP = [sys.executable, "-m", "transformer.interop.export_cli", "--help"]
TEXT = {"capture_output": True, "text": True, "timeout": 300}


@pytest.fixture
def server() -> dict[str, Any]:
    """This test process's fork server (started by an earlier test, or now)."""
    if os.environ.get("AIAYN_TEST_FORKSERVER", "1") == "0":
        pytest.skip("AIAYN_TEST_FORKSERVER=0: every command is a plain subprocess")
    started = forkserver._start()
    assert started is not None
    return started


def test_a_new_test_forks_from_the_running_server(server: dict[str, Any]) -> None:
    """pytest sets PYTEST_CURRENT_TEST anew for each test: the server started in an earlier test (a value of
    its own) still forks this test's commands, and they run as that command line runs."""
    before = dict(forkserver.STARTED)
    for test in ("tests/unit/test_a.py::test_one (call)", "tests/unit/test_b.py::test_two (setup)"):
        env = {**server["env"], "PYTEST_CURRENT_TEST": test}
        done = forkserver.run(HELP, cwd=REPO_ROOT, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "--to" in done.stdout
    assert forkserver.STARTED["forked"] - before["forked"] == 2, forkserver.STARTED
    assert forkserver.STARTED["subprocess"] == before["subprocess"]


def test_code_runs_forked_as_python_c_runs_it(server: dict[str, Any]) -> None:
    code = "import sys; print(__name__, sys.argv, repr(sys.path[0])); sys.exit(sys.stdin.read().strip())"
    before = dict(forkserver.STARTED)
    done = forkserver.run([sys.executable, "-c", code, "a", "b"], cwd=REPO_ROOT, env=server["env"], input="3")
    assert forkserver.STARTED["forked"] - before["forked"] == 1, forkserver.STARTED
    assert (done.returncode, done.stdout, done.stderr) == (1, "__main__ ['-c', 'a', 'b'] ''\n", "3\n")
    plain = subprocess.run([sys.executable, "-c", code, "a", "b"], cwd=REPO_ROOT, input="3", **TEXT)
    assert (plain.returncode, plain.stdout, plain.stderr) == (done.returncode, done.stdout, done.stderr)


def test_only_variables_read_at_run_time_may_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    server = {k: v for k, v in cli_env().items() if k not in forkserver.SET_BY_IMPORTS}
    forkable = [
        {**server, "PYTEST_CURRENT_TEST": "tests/x.py::test_y (call)"},
        {**server, "WANDB_MODE": "offline", "MULTI30K_DIR": "/data"},
        {**server, "PL_GLOBAL_SEED": "42", "PL_SEED_WORKERS": "1", "MASTER_PORT": "29500"},  # in-process runs
        # what the test process's own imports set (train.py, Lightning, torch's compiler), the server has
        {**server, **forkserver.SET_BY_IMPORTS},
    ]
    for env in forkable:
        assert forkserver._forkable(HELP, REPO_ROOT, env, server), set(env) ^ set(server)
    assert forkserver._forkable(HELP, REPO_ROOT, server, forkable[-1])  # the other way round
    assert not forkserver._forkable(HELP, REPO_ROOT, {**server, "OMP_WAIT_POLICY": "ACTIVE"}, server)
    for name in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES"):  # read at import
        with monkeypatch.context() as patched:  # CUDA_*: by a torch built with CUDA
            patched.setattr(forkserver, "_torch_without_cuda", lambda: False)
            assert not forkserver._forkable(
                HELP, REPO_ROOT, {**server, name: server.get(name, "") + "0"}, server
            ), name
    # submitit's local jobs set CUDA_VISIBLE_DEVICES (empty without GPUs): nothing reads it in a CPU build
    monkeypatch.setattr(forkserver, "_torch_without_cuda", lambda: True)
    assert forkserver._forkable(HELP, REPO_ROOT, {**server, "CUDA_VISIBLE_DEVICES": ""}, server)
    assert not forkserver._forkable(HELP, REPO_ROOT, {**server, "OMP_NUM_THREADS": "7"}, server)
    elsewhere = REPO_ROOT / "tests"
    assert not forkserver._forkable(HELP, elsewhere, server, server)  # -m from another directory
    assert not forkserver._forkable(["/usr/bin/env", "true"], REPO_ROOT, server, server)
    driver = [sys.executable, "-m", "tests.helpers.driver", "plan.json", "results.json"]  # the driver
    assert forkserver._forkable(driver, REPO_ROOT, server, server)
    assert not forkserver._forkable([*driver[:2], "tests.helpers.forkserver"], REPO_ROOT, server, server)
    bench = [sys.executable, "-m", "benchmarks.gpu.bench_gpu", "--smoke"]
    assert forkserver._forkable(bench, REPO_ROOT, server, server)
    assert not forkserver._forkable(bench, elsewhere, server, server)
    assert not forkserver._forkable([*bench[:2], "json.tool"], REPO_ROOT, server, server)  # not this tree's
    code = [sys.executable, "-c", "pass"]
    assert forkserver._forkable(code, REPO_ROOT, server, server)
    assert not forkserver._forkable(code, elsewhere, server, server)  # its imports: another folder's
    # submitit's job controller and (unbuffered) job, which a sweep under hydra/launcher=local starts
    jobs = {**server, "SUBMITIT_LOCAL_JOB_ID": "123"}
    for job in (["-m", "submitit.local._local", "folder"], ["-u", "-m", "submitit.core._submit", "folder"]):
        assert forkserver._forkable([sys.executable, *job], elsewhere, jobs, server), job
    assert not forkserver._forkable([sys.executable, "-u"], REPO_ROOT, server, server)
    assert not forkserver._forkable([sys.executable, "-m", "submitit.other"], elsewhere, server, server)


def test_on_start_gets_the_pid_of_the_commands_process(server: dict[str, Any]) -> None:
    """Forked or (a command the server does not take) a plain subprocess: `on_start` gets the pid of
    the process that runs the command, while it runs (a test signals it from another thread)."""
    env = server["env"]
    seen: list[tuple[int, str]] = []

    def started(pid: int) -> None:
        seen.append((pid, Path(f"/proc/{pid}/cmdline").read_text()))  # it exists: it is running

    before = dict(forkserver.STARTED)
    sleep = [sys.executable, "-c", "import time; time.sleep(0.2)"]
    for command, cwd in ((HELP, REPO_ROOT), (sleep, REPO_ROOT / "tests")):  # forked, then plain
        seen.clear()
        done = forkserver.run(command, cwd=cwd, env=env, timeout=300, on_start=started)
        assert done.returncode == 0 and len(seen) == 1, (command, seen)
        pid, _ = seen[0]
        assert pid != os.getpid() and not Path(f"/proc/{pid}").exists()  # ended with the command
    assert {k: forkserver.STARTED[k] - before[k] for k in before} == {"forked": 1, "subprocess": 1}


def test_fresh_is_a_new_interpreter_whatever_the_server_would_take(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forkserver, "_forkable", lambda *args: True)  # everything forkable but for `fresh`
    before = dict(forkserver.STARTED)
    done = forkserver.run([sys.executable, "-c", "print('ran')"], cwd=REPO_ROOT, timeout=300, fresh=True)
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr
    assert {k: forkserver.STARTED[k] - before[k] for k in before} == {"forked": 0, "subprocess": 1}


# a forked command that starts children of its own: `python -c` of this tree with inherited streams forks
# from the server (its parent is the server), one with a pipe is the command's own child
CHILDREN = """
import os, signal, subprocess, sys, time
def python(code):
    return [sys.executable, "-c", "import os, sys, time; " + code]
served = subprocess.Popen(python("print('child', os.getppid()); sys.exit(3)"))
assert served.wait(timeout=300) == 3 and served.poll() == 3 and served.returncode == 3
piped = subprocess.run(python("print(os.getppid())"), capture_output=True, text=True)
print("piped", piped.stdout.strip(), "mine", os.getpid())
sleep = "print('sleeping', os.getppid(), flush=True); open(READY, 'w'); time.sleep(300)"
sleeper = subprocess.Popen(python(sleep))
while not os.path.exists(READY):
    time.sleep(0.01)
assert sleeper.poll() is None
sleeper.send_signal(signal.SIGTERM)
print("terminated", sleeper.wait(timeout=300), flush=True)
"""


def test_a_forked_commands_own_python_children_fork_from_the_server(
    server: dict[str, Any], tmp_path: Path
) -> None:
    """Lightning's DDP launcher re-runs the command line for each other rank with `subprocess.Popen`: in a
    forked command such a child forks from the server too (its parent pid is the server's), with the exit
    status, `wait`, `poll` and signals of a child; a child with pipes stays the command's own process."""
    code = CHILDREN.replace("READY", repr(str(tmp_path / "ready")))
    done = forkserver.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=server["env"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["child"] == str(server["process"].pid), done.stdout  # the served child's parent
    piped, mine = lines["piped"].split(" mine ")
    assert piped == mine, done.stdout  # a pipe: a plain child of the command
    assert lines["sleeping"] == str(server["process"].pid), done.stdout
    assert lines["terminated"] == str(-signal.SIGTERM), done.stdout


# --- a child's environment is exactly the one asked for: nothing of the server's own leaks in ---------

ENVIRON = "import json, os; print(json.dumps(dict(os.environ)))"


def _forked(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    before = dict(forkserver.STARTED)
    done = forkserver.run(argv, cwd=REPO_ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert forkserver.STARTED["forked"] - before["forked"] == 1, "ran as a plain subprocess"
    return done


def test_a_forked_child_gets_exactly_the_environment_asked_for(server: dict[str, Any]) -> None:
    """The server's own variables (its start environment: HYDRA_FULL_ERROR, PYTHONUNBUFFERED; what it set
    itself: OMP_WAIT_POLICY) are not in a child that was not given them; a seed given to one child
    (PL_GLOBAL_SEED, as an in-process run sets it) is in that child only."""
    assert "HYDRA_FULL_ERROR" in server["env"] and "PYTHONUNBUFFERED" in server["env"]
    drop = {"HYDRA_FULL_ERROR", "PYTHONUNBUFFERED", "OMP_WAIT_POLICY", "PYTEST_CURRENT_TEST"}
    asked = {k: v for k, v in server["env"].items() if k not in drop}
    seeded = {**asked, "PL_GLOBAL_SEED": "1234", "PYTEST_CURRENT_TEST": "tests/x.py::test_y (call)"}
    code = [sys.executable, "-c", ENVIRON]
    assert json.loads(_forked(code, seeded).stdout) == seeded
    assert json.loads(_forked(code, asked).stdout) == asked  # no seed left over from the child before


def test_forked_children_draw_their_own_random_numbers(server: dict[str, Any]) -> None:
    """`random` and NumPy are reseeded in each child, as in a new interpreter: two children do not repeat
    the server's (or each other's) numbers."""
    code = [sys.executable, "-c", "import random, numpy; print(random.random(), numpy.random.random())"]
    first, second = (_forked(code, server["env"]).stdout.split() for _ in range(2))
    assert first[0] != second[0] and first[1] != second[1], (first, second)


def test_a_hash_seed_runs_in_a_new_interpreter_with_that_seed(server: dict[str, Any]) -> None:
    """PYTHONHASHSEED is read when an interpreter starts: a child forked from the server would hash with
    the server's seed, so a command asking for another one runs as a plain subprocess."""
    code = [sys.executable, "-c", "print(hash('attention'))"]
    hashes = []
    for seed in ("0", "1"):
        before = dict(forkserver.STARTED)
        env = {**server["env"], "PYTHONHASHSEED": seed}
        done = forkserver.run(code, cwd=REPO_ROOT, env=env, timeout=300)
        assert forkserver.STARTED["subprocess"] - before["subprocess"] == 1
        plain = subprocess.run(code, cwd=REPO_ROOT, env=env, **TEXT)
        assert done.stdout == plain.stdout and done.returncode == 0
        hashes.append(done.stdout)
    assert hashes[0] != hashes[1]
