"""`python serve.py` as a user runs it, on 127.0.0.1 and a free port: a bad serve config ends with one
`error:` line naming its key, exit status 1 and nothing listening; a good one serves the model (the same
translations as the inference API); SIGTERM with a request in flight: that request gets its 200, no new
connection is accepted, and the command exits 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.cli import run_script
from tests.helpers.repo import REPO_ROOT, cli_env
from tests.helpers.serving import free_port, served_run, source_lines
from transformer.inference import Translator

pytestmark = pytest.mark.slow

served_run = served_run  # a session fixture (tests/helpers/serving.py)


@pytest.fixture(scope="module")
def checkpoint(served_run: Path) -> Path:
    return served_run / "checkpoints" / "last.ckpt"


def models(*entries: str) -> str:
    """The Hydra override `models=[{...}, ...]` of entries written as `id: x, checkpoint: 'path', ...`."""
    return "models=[" + ", ".join(f"{{{entry}}}" for entry in entries) + "]"


def serve_args(tmp_path: Path, port: int, *overrides: str) -> list[str]:
    return [f"hydra.run.dir={tmp_path / 'serve_run'}", f"port={port}", *overrides]


def not_listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def assert_one_error_line(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 1, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Serving" not in result.stderr
    for word in words:
        assert word in errors[0], errors[0]


def test_bad_serve_configs_end_in_one_line_before_anything_listens(checkpoint: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "notes.ckpt"
    foreign.write_text("not a checkpoint\n")
    good = f"id: t, checkpoint: '{checkpoint}'"
    cases = {
        "missing checkpoint": (
            [models(f"id: t, checkpoint: '{tmp_path / 'gone.ckpt'}'")],
            "models[0].checkpoint",
        ),
        "foreign checkpoint": ([models(f"id: t, checkpoint: '{foreign}'")], "models[0].checkpoint"),
        "unknown backend": ([models(f"{good}, backend: onnx")], "models[0].backend=onnx"),
        "unknown device": ([models(f"{good}, device: tpu")], "models[0].device=tpu"),
        "bad decoding default": ([models(f"{good}, decoding: {{beam_size: 0}}")], "models[0].decoding"),
        "duplicate ids": ([models(good, good)], "models[1].id=t"),
        "no models": ([], "models is empty"),
        "beyond loopback without a key": ([models(good), "host=0.0.0.0"], "host=0.0.0.0", "api_key"),
    }
    for name, (overrides, *words) in cases.items():
        port = free_port()
        result = run_script("serve.py", serve_args(tmp_path, port, *overrides), env=cli_env(), timeout=300)
        assert_one_error_line(result, *words)
        assert not_listening(port), name
    with socket.socket() as taken:  # a port another server listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_script("serve.py", serve_args(tmp_path, port, models(good)), env=cli_env(), timeout=300)
        assert_one_error_line(result, f"port={port} is in use")


@pytest.fixture
def server(checkpoint: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`python serve.py` with the checkpoint as model `t`, until it is ready; killed after the test."""
    port = free_port()
    args = serve_args(tmp_path, port, models(f"id: t, checkpoint: '{checkpoint}'"), "batching.max_wait_ms=2")
    log = (tmp_path / "serve.err").open("w")
    process = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "serve.py"), *args],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (tmp_path / "serve.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "serve.py was not ready within 120 s"
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        log.close()


def test_serves_the_model_and_stops_gracefully_on_sigterm(server, checkpoint: Path, tmp_path: Path) -> None:
    process, url = server
    translator = Translator.from_checkpoint(checkpoint)
    lines = source_lines(3)
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert [m["id"] for m in client.get("/v1/models").json()["models"]] == ["t"]
        body = client.post("/v1/translate", json={"model": "t", "segments": lines, "beam_size": 4}).json()
        assert [t["translation"] for t in body["translations"]] == [
            t.text for t in translator.translate(lines, beam_size=4)
        ]

        heavy = source_lines(256, seed=4)
        request = {"model": "t", "segments": heavy, "beam_size": 16, "min_len": 60, "max_len_b": 80}
        answer: dict[str, httpx.Response] = {}
        sender = threading.Thread(
            target=lambda: answer.setdefault(
                "r", httpx.post(f"{url}/v1/translate", json=request, timeout=120)
            )
        )
        sender.start()
        deadline = time.monotonic() + 30
        while in_flight(client) < 1:  # the request is being answered
            assert time.monotonic() < deadline and sender.is_alive()
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(f"{url}/health", timeout=2)
        sender.join(120)
    response = answer["r"]
    assert response.status_code == 200, response.text[:500]
    want = translator.translate(heavy[:8], beam_size=16, min_len=60, max_len_b=80)  # a sample: the rest alike
    assert [t["translation"] for t in response.json()["translations"][:8]] == [t.text for t in want]
    assert len(response.json()["translations"]) == len(heavy)
    assert process.wait(60) == 0, (tmp_path / "serve.err").read_text()[-3000:]
    assert "Server stopped" in (tmp_path / "serve.err").read_text()


def in_flight(client: httpx.Client) -> float:
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    samples = families["aiayn_requests_in_flight"].samples
    return sum(s.value for s in samples if s.labels["endpoint"] == "/v1/translate")
