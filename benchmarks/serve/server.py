"""`python serve.py` as a measured process: started on a free port of 127.0.0.1 with one model and the
batching limits asked for, ready when /ready answers 200 (a bounded wait), its resident memory read from
/proc, its Prometheus counters read from /metrics, stopped with SIGTERM."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_ID = "load"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


class Server:
    """One `serve.py` process serving `checkpoint` as model "load" on `backend` ("torch", "ctranslate2", or
    "ctranslate2:COMPUTE_TYPE", e.g. ctranslate2:int8) with `batching` (serve.yaml's batching keys), its
    log in `out`; CTranslate2's converted model kept in `cache_dir`; `decoding`: the model's decoding
    defaults over the checkpoint's. A context manager: ready on entry, stopped on exit."""

    def __init__(
        self,
        checkpoint: Path,
        backend: str,
        batching: Mapping[str, float],
        out: Path,
        cache_dir: Path | None = None,
        decoding: Mapping[str, float] | None = None,
        ready_s: float = 600,
    ) -> None:
        self.checkpoint, self.backend, self.batching, self.out = checkpoint, backend, dict(batching), out
        self.cache_dir, self.decoding, self.ready_s = cache_dir, dict(decoding or {}), ready_s
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        name, _, compute_type = self.backend.partition(":")
        entry = [f"id: {MODEL_ID}", f"checkpoint: '{self.checkpoint}'", f"backend: {name}"]
        if compute_type:
            entry.append(f"compute_type: {compute_type}")
        if name == "ctranslate2" and self.cache_dir is not None:
            entry.append(f"cache_dir: '{self.cache_dir}'")  # converted once, for both batching settings
        if self.decoding:  # the model's defaults (CTranslate2 refuses defaults it cannot decode as ours)
            entry.append("decoding: {" + ", ".join(f"{k}: {v}" for k, v in self.decoding.items()) + "}")
        model = "{" + ", ".join(entry) + "}"
        return [
            sys.executable, "serve.py", "host=127.0.0.1", f"port={self.port}", f"models=[{model}]",
            f"hydra.run.dir={self.out}", *[f"batching.{key}={value}" for key, value in self.batching.items()],
        ]  # fmt: skip

    def __enter__(self) -> Server:
        self.out.mkdir(parents=True, exist_ok=True)
        log = (self.out / "console.log").open("w")
        self.process = subprocess.Popen(self.command(), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child has its own descriptor
        deadline = time.monotonic() + self.ready_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve.py exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if _get(f"{self.url}/ready", timeout=5)[0] == 200:
                    return self
            except OSError:  # not listening yet (the port is bound, the models load)
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"serve.py not ready within {self.ready_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()  # SIGTERM: finishes what is in flight, exits 0
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        path = self.out / "console.log"
        return path.read_text(errors="replace")[-chars:] if path.is_file() else ""

    def rss_mb(self) -> float:
        """The server process's resident set size (VmRSS), MB."""
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1)) / 1024

    def batch_counts(self) -> tuple[float, float]:
        """(segments, model calls) so far for the model, from /metrics' `aiayn_batch_segments` histogram."""
        status, text = _get(f"{self.url}/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {text[:300]}")

        def value(name: str) -> float:
            found = re.search(rf'^{name}\{{model="{MODEL_ID}"\}} (\S+)$', text, re.MULTILINE)
            return float(found.group(1)) if found else 0.0

        return value("aiayn_batch_segments_sum"), value("aiayn_batch_segments_count")


class RssSampler:
    """The server's peak RSS while the load runs (sampled every `every_s` in a thread)."""

    def __init__(self, server: Server, every_s: float = 0.5) -> None:
        self.server, self.every_s, self.peak = server, every_s, server.rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.peak = max(self.peak, self.server.rss_mb())
            except (OSError, AttributeError):  # the process ended
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
