"""`python train.py ...` and `python evaluate.py ...` as forked children of a warm interpreter.

Importing torch, Lightning, Hydra and the project is most of what a tiny training run in a test costs
(about two thirds of one, measured with cProfile on the 2-core CI machine). `run(argv, ...)`, a drop-in for
`subprocess.run(argv, capture_output=True, text=True, ...)`, hands a command of the form `[sys.executable,
SCRIPT, *ARGS]` (or `-m MODULE` of this tree, `-c CODE`) to a server process that imported those libraries
once (`python -m tests.helpers.forkserver`, one per test process) and forks a child for it. The child is a
real process, as the command line makes one: its own pid, exit status, stdout, stderr, working directory,
environment, stdin, `sys.argv` and `sys.path[0]`, reseeded `random`/NumPy generators, atexit handlers run
at its end; only the imports are skipped. Everything else runs as a plain subprocess: other command forms,
scripts of another tree (they would get this tree's modules), and commands whose environment differs from
the server's in a variable that is not on `RUNTIME_ENV` (variables libraries read when they are imported:
`OMP_*`, `HF_*`, `CUDA_*`, ...). `AIAYN_TEST_FORKSERVER=0` makes every command a plain subprocess.

Inside a forked command, a command of the same kind that it starts itself with `subprocess.Popen` (Lightning's
DDP launcher re-running the command line for each other rank; submitit's local job controller and job,
`python [-u] -m submitit...`, under `hydra/launcher=local`) forks from the server too, when its standard
streams are inherited or files (not pipes): its `Popen` object has the pid, `poll`, `wait`, signals and exit
status of a child, but the process is the server's child (its parent pid is the server's).
"""

from __future__ import annotations

import atexit
import contextlib
import getpass
import json
import os
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.helpers.repo import REPO_ROOT, cli_env

# read when a command runs, not when a library is imported: a difference here still forks. pytest sets
# PYTEST_CURRENT_TEST anew for each test and phase, and in-process runs of the tests set Lightning's seed
# (PL_GLOBAL_SEED), the DDP rendezvous, cuBLAS's workspace: without them here, commands after such a test
# ran as plain subprocesses
RUNTIME_ENV = {
    "PROJECT_ROOT",
    "HYDRA_FULL_ERROR",
    "PYTHONUNBUFFERED",
    "MULTI30K_DIR",
    "SST2_DIR",
    "PYTEST_CURRENT_TEST",
    "CUBLAS_WORKSPACE_CONFIG",
    "TOKENIZERS_PARALLELISM",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
}
RUNTIME_PREFIXES = ("WANDB_", "PL_", "SUBMITIT_")
# set in a process by its own imports when absent, to the value they would have in the server anyway
# (train.py and the server set OMP_WAIT_POLICY; Lightning the NVML check; torch's compiler its cache
# directory): absent on one side and this value on the other is no difference
SET_BY_IMPORTS = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"),
}
# `python -m MODULE` forms the server takes: modules of this tree's packages (the command-line modules, the
# benchmarks, tests/helpers/driver.py), not the server itself
FORKABLE_MODULES = ("transformer.", "benchmarks.", "tests.")
# `python -m MODULE` of a library the server imported, from any directory: submitit's local job controller
# and job (`hydra/launcher=local`), which a forked sweep starts
LIBRARY_MODULES = ("submitit.local._local", "submitit.core._submit")
STARTED = {"forked": 0, "subprocess": 0}  # how this process's commands ran (tests/unit/test_forkserver.py)


# --- wire: one length-prefixed JSON message each way -----------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _receive(sock: socket.socket) -> dict[str, Any] | None:
    header = _exactly(sock, 4)
    if header is None:
        return None
    data = _exactly(sock, struct.unpack("!I", header)[0])
    return None if data is None else json.loads(data)


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# --- the server -----------------------------------------------------------------------------------


def exit_status(exit_: SystemExit) -> int:
    """The exit status Python gives `raise SystemExit(code)` at the top of a script; a code that is not
    an integer (`SystemExit("error: ...")`) is printed on stderr first, as Python prints it."""
    if exit_.code is None:
        return 0
    if isinstance(exit_.code, int):
        return exit_.code
    print(exit_.code, file=sys.stderr)
    return 1


def _child(
    request: dict[str, Any], closing: list[socket.socket], fds: list[int], server: dict[str, Any]
) -> None:
    """In the forked child: become `python SCRIPT ARGS` and run it (standard streams: the request's files, or
    `fds` its client passed); never returns."""
    status = 1
    try:
        for sock in closing:
            sock.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if fds:
            for fd, passed in enumerate(fds):
                os.dup2(passed, fd)
            for passed in set(fds) - {0, 1, 2}:
                os.close(passed)
        else:
            for fd, path, flags in (
                (0, request["stdin"], os.O_RDONLY),
                (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                (2, request["stderr"], os.O_WRONLY | os.O_TRUNC),
            ):
                opened = os.open(path, flags)
                os.dup2(opened, fd)
                os.close(opened)
        _SERVER.update(server)  # the command's own `python SCRIPT` children fork from the server too
        subprocess.Popen = _ServedPopen  # type: ignore[misc]
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        unbuffered = bool(env.get("PYTHONUNBUFFERED")) or request.get("unbuffered", False)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=1 if unbuffered else -1)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
        sys.stdout.reconfigure(write_through=unbuffered)
        sys.stderr.reconfigure(write_through=True)
        os.chdir(request["cwd"])
        module, code = request.get("module"), request.get("code")
        if module:  # python -m MODULE: argv[0] becomes the module's file, sys.path[0] the directory
            sys.argv = ["-m", *request["args"]]
            sys.path[0] = request["cwd"]
        elif code is not None:  # python -c CODE
            sys.argv = ["-c", *request["args"]]
            sys.path[0] = ""
        else:
            script = os.path.abspath(os.path.join(request["cwd"], request["script"]))
            sys.argv = [request["script"], *request["args"]]
            sys.path[0] = os.path.dirname(script)
        import random

        import numpy

        random.seed()
        numpy.random.seed()
        import runpy

        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            elif code is not None:
                exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            else:
                runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as exit_:
            status = exit_status(exit_)
        except KeyboardInterrupt:
            import traceback

            traceback.print_exc()
            status = 128 + signal.SIGINT
        except BaseException:
            import traceback

            traceback.print_exc()
            status = 1
        import threading

        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: non-daemon threads end
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def serve(path: str, parent: int) -> None:
    """Accept commands on the UNIX socket `path` until the test process `parent` is gone."""
    served = {"path": path, "env": dict(os.environ)}  # what its clients compare their commands' with
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py sets it, before torch is imported
    import hydra  # noqa: F401
    import lightning  # noqa: F401
    import matplotlib  # noqa: F401
    import torch  # noqa: F401

    import transformer.cli.build
    import transformer.cli.evaluate_steps
    import transformer.evaluation.reports
    import transformer.training  # noqa: F401

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    waiting: list[socket.socket] = []  # connected, request not read yet
    running: dict[int, socket.socket] = {}  # child pid -> its client
    while os.getppid() == parent:
        readable, _, _ = select.select([server, *waiting], [], [], 0.05)
        for sock in readable:
            if sock is server:
                waiting.append(server.accept()[0])
                continue
            waiting.remove(sock)
            request = _receive(sock)
            if request is None:
                sock.close()
                continue
            fds = socket.recv_fds(sock, 1, 3)[1] if request.get("fds") else []
            pid = os.fork()
            if pid == 0:
                _child(request, [server, sock, *waiting, *running.values()], fds, served)
            for fd in fds:
                os.close(fd)
            _send(sock, {"pid": pid})
            running[pid] = sock
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            sock = running.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                _send(sock, {"returncode": code})
            sock.close()


# --- the client -----------------------------------------------------------------------------------

_server: dict[str, Any] = {}


def _start() -> dict[str, Any] | None:
    if os.environ.get("AIAYN_TEST_FORKSERVER", "1") == "0":
        return None
    if not _server:
        folder = tempfile.mkdtemp(prefix="forkserver_")
        path = os.path.join(folder, "socket")
        env = cli_env()
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.forkserver", path, str(os.getpid())],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        atexit.register(process.kill)
        _server.update(process=process, path=path, env=env, folder=folder)
    return _server


def _forkable(argv: list[str], cwd: Path, env: dict[str, str], server_env: dict[str, str]) -> bool:
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    argv, _ = _unbuffered(argv)
    if len(argv) < 2:
        return False
    if argv[1] == "-m" and len(argv) > 2 and argv[2] in LIBRARY_MODULES:
        pass
    elif argv[1] == "-m":  # this tree's package, run from this tree
        module = argv[2] if len(argv) > 2 else ""
        if (
            not module.startswith(FORKABLE_MODULES)
            or module == "tests.helpers.forkserver"
            or cwd != REPO_ROOT
        ):
            return False
    elif argv[1] == "-c":  # code run from this tree (its imports are this tree's modules)
        if len(argv) < 3 or cwd != REPO_ROOT:
            return False
    elif not argv[1].endswith(".py") or (cwd / argv[1]).resolve().parent != REPO_ROOT:
        return False  # another tree's script would get this tree's modules
    differing = {k for k in set(env) | set(server_env) if env.get(k) != server_env.get(k)}
    return all(
        k in RUNTIME_ENV
        or k.startswith(RUNTIME_PREFIXES)
        or {env.get(k), server_env.get(k)} == {None, SET_BY_IMPORTS.get(k)}
        or (k.startswith("CUDA_") and _torch_without_cuda())
        for k in differing
    )


def _torch_without_cuda() -> bool:
    """A torch built without CUDA reads no `CUDA_*` variable (submitit's jobs set `CUDA_VISIBLE_DEVICES`);
    unknown (torch not imported here) counts as built with it."""
    torch = sys.modules.get("torch")
    return torch is not None and getattr(getattr(torch, "version", None), "cuda", "") is None


def _connect(server: dict[str, Any], timeout: float) -> socket.socket:
    """A connection to the server, waiting for it to start (its imports take seconds)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        if server["process"].poll() is not None:
            raise RuntimeError(f"the test fork server exited with status {server['process'].returncode}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(server["path"])
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _unbuffered(argv: list[str]) -> tuple[list[str], bool]:
    """`python -u ...` (unbuffered streams, as submitit starts its job) as `python ...` and whether it was."""
    if len(argv) > 1 and argv[1] == "-u":
        return [argv[0], *argv[2:]], True
    return argv, False


def _request(argv: list[str], cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    argv, unbuffered = _unbuffered(argv)
    option = argv[1] in ("-m", "-c")
    return {
        "unbuffered": unbuffered,
        "script": argv[1],
        "module": argv[2] if argv[1] == "-m" else None,
        "code": argv[2] if argv[1] == "-c" else None,
        "args": argv[3:] if option else argv[2:],
        "cwd": str(cwd),
        "env": env,
    }


def run(
    argv: list[str],
    *,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    input: str | None = None,
    timeout: float | None = None,
    on_start: Callable[[int], object] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv, cwd=, env=, input=, timeout=, capture_output=True, text=True)`; `on_start(pid)`
    is called once the command's process exists (a test that signals it runs `run` in a thread); `fresh`
    starts a new interpreter as a user does (what its imports print is part of its output)."""
    argv = [str(a) for a in argv]
    env = dict(os.environ if env is None else env)
    server = None if fresh else _start()
    cwd = Path(cwd or os.getcwd()).resolve()
    if server is None or not _forkable(argv, cwd, env, server["env"]):
        STARTED["subprocess"] += 1
        with subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            text=True,
            stdin=None if input is None else subprocess.PIPE,  # as subprocess.run: inherited unless given
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ) as process:
            if on_start is not None:
                on_start(process.pid)
            try:
                stdout, stderr = process.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                raise
        return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
    STARTED["forked"] += 1
    with tempfile.TemporaryDirectory(prefix="run_", dir=server["folder"]) as folder:
        files = {name: os.path.join(folder, name) for name in ("stdin", "stdout", "stderr")}
        for name, text in (("stdin", input or ""), ("stdout", ""), ("stderr", "")):
            Path(files[name]).write_text(text, encoding="utf-8")
        request = {**_request(argv, cwd, env), **files}
        sock = _connect(server, timeout=300)
        try:
            _send(sock, request)
            pid = (_receive(sock) or {})["pid"]
            if on_start is not None:
                on_start(pid)
            sock.settimeout(timeout)
            try:
                answer = _receive(sock)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(argv, timeout or 0) from None
        finally:
            sock.close()
        if answer is None:
            raise RuntimeError(f"the test fork server lost the command {argv}")
        read = {name: Path(files[name]).read_text(encoding="utf-8", errors="replace") for name in files}
    return subprocess.CompletedProcess(argv, answer["returncode"], read["stdout"], read["stderr"])


# --- inside a forked command: its own `python SCRIPT` children --------------------------------------

_SERVER: dict[str, Any] = {}  # in a forked command: the server's socket path and environment
# `Popen` keyword arguments a served child honours (the streams only when inherited, a file or an fd)
# (text, encoding and errors only concern pipes, which a served child has none of)
_SERVABLE = {"env", "cwd", "stdin", "stdout", "stderr", "close_fds", "shell", "text", "encoding", "errors"}


class _ServedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """`subprocess.Popen` in a forked command: a command `_forkable` takes (`[sys.executable, SCRIPT, ...]` of
    this tree, submitit's jobs) whose streams are not pipes forks from the server; anything else is a plain
    `Popen`."""

    _sock: socket.socket | None = None  # the connection the server answers with the exit status, if served

    def __init__(self, args: Any, *positional: Any, **kwargs: Any) -> None:
        served = self._served(args, positional, kwargs)
        if served is None:
            super().__init__(args, *positional, **kwargs)
            return
        request, fds = served
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(_SERVER["path"])
            _send(sock, {**request, "fds": True})
            socket.send_fds(sock, [b"\0"], fds)
            answer = _receive(sock)
        finally:
            for fd in fds:  # this process's copies: the server's child has its own
                os.close(fd)
        if answer is None:
            sock.close()
            raise OSError(f"the test fork server did not start {args}")
        self.args, self.pid, self.returncode = args, answer["pid"], None
        self.stdin = self.stdout = self.stderr = None
        self.text_mode, self.encoding, self.errors = False, None, None
        self._child_created = False  # not this process's child: Popen's own waitpid must not reap it
        self._communication_started, self._input, self._sigint_wait_secs = False, None, 0
        self._sock, self._lock = sock, threading.Lock()

    @staticmethod
    def _served(
        args: Any, positional: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], list[int]] | None:
        """The request and the standard streams (copies of their fds) of a command the server takes."""
        if positional or not set(kwargs) <= _SERVABLE or not isinstance(args, list | tuple):
            return None
        argv = [os.fspath(a) for a in args]
        if not argv or argv[0] != sys.executable or kwargs.get("close_fds", True) is not True:
            return None
        if kwargs.get("shell"):
            return None
        cwd = Path(kwargs.get("cwd") or os.getcwd()).resolve()
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        if not _forkable(argv, cwd, env, _SERVER["env"]):
            return None
        fds = []
        for fd, stream in enumerate(kwargs.get(name) for name in ("stdin", "stdout", "stderr")):
            if stream is None:
                fds.append(os.dup(fd))
            elif stream == subprocess.DEVNULL:
                fds.append(os.open(os.devnull, os.O_RDWR))
            elif isinstance(stream, int) and stream >= 0:
                fds.append(os.dup(stream))
            elif hasattr(stream, "fileno"):
                fds.append(os.dup(stream.fileno()))
            else:  # a pipe (or STDOUT): Popen makes it
                for opened in fds:
                    os.close(opened)
                return None
        return _request(argv, cwd, env), fds

    def _returned(self, answer: dict[str, Any] | None) -> None:
        self._sock.close()
        # the server lost it (it ended with the test process): as a child killed
        self.returncode = -signal.SIGKILL if answer is None else answer["returncode"]

    def poll(self) -> int | None:
        if self._sock is None:
            return super().poll()
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                if self.returncode is None and select.select([self._sock], [], [], 0)[0]:
                    self._returned(_receive(self._sock))
            finally:
                self._lock.release()
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> Any:
        if self._sock is None:
            return super().communicate(input, timeout)
        if input:
            raise ValueError("a served child's stdin is not a pipe")
        self.wait(timeout)
        return None, None

    def wait(self, timeout: float | None = None) -> int:
        if self._sock is None:
            return super().wait(timeout)
        with self._lock:
            if self.returncode is None:
                self._sock.settimeout(timeout)
                try:
                    self._returned(_receive(self._sock))
                except TimeoutError:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        return self.returncode


@contextlib.contextmanager
def in_a_thread(
    start: Callable[..., subprocess.CompletedProcess[str]], *args: Any, **kwargs: Any
) -> Iterator[tuple[int, Future[subprocess.CompletedProcess[str]]]]:
    """`start(*args, **kwargs, on_start=...)` (`run`, or a helper that calls it) in a thread: yields the pid
    of the command's process once it exists and the future of its result, for a test that signals it."""
    started: queue.Queue[int] = queue.Queue()
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(start, *args, **kwargs, on_start=started.put)
        yield started.get(timeout=300), future


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
