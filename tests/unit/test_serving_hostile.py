"""Hostile clients against a real tiny checkpoint behind uvicorn on 127.0.0.1: malformed JSON, wrong types,
an empty segment list, 10,000 segments, a 1 MB segment, invalid UTF-8, a negative beam, n_best above the
beam, an unknown model, a client that disconnects mid-request, a deadline missed, 200 requests past the
queue's bound. Each gets its status and a JSON error body, /health answers throughout, and the next good
request is answered correctly."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.serving import served_run, serving, settings, source_lines
from transformer.inference import Translator
from transformer.serving.app import create_app

pytestmark = pytest.mark.slow

served_run = served_run  # a session fixture (tests/helpers/serving.py)


@pytest.fixture(scope="module")
def checkpoint(served_run: Path) -> Path:
    return served_run / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def translator(checkpoint: Path) -> Translator:
    return Translator.from_checkpoint(checkpoint)


class HealthWatch:
    """Asks /health every 50 ms in a thread while the test runs; every answer must be a fast 200."""

    def __init__(self, url: str) -> None:
        self.url, self.answers, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while not self.stop.wait(0.05):
                start = time.monotonic()
                try:
                    status = client.get("/health").status_code
                except httpx.HTTPError as err:
                    status = repr(err)
                self.answers.append((status, time.monotonic() - start))

    def __enter__(self) -> HealthWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        assert self.answers, "/health was never asked"
        assert all(status == 200 for status, _ in self.answers), self.answers
        assert max(seconds for _, seconds in self.answers) < 2.0


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"} and body["error"]["status"] == status and body["error"]["message"]
    return body["error"]


@pytest.fixture(scope="module")
def server(checkpoint: Path, translator: Translator):
    values = {"batching": {"max_segments": 64, "max_chars": 20_000}}
    with serving(create_app(settings({"t": str(checkpoint)}, **values), {"t": translator})) as url:
        yield url


def good_request_is_correct(client: httpx.Client, translator: Translator) -> None:
    lines = source_lines(2, seed=9)
    body = client.post("/v1/translate", json={"model": "t", "segments": lines, "beam_size": 4}).json()
    assert [t["translation"] for t in body["translations"]] == [
        t.text for t in translator.translate(lines, beam_size=4)
    ]


BAD_BODIES = {
    # name: (raw body, status, the field named (None: none), words of the message)
    "malformed JSON": (b'{"model": "t", "segments": [', 422, None, "not valid JSON"),
    "not an object": (b'["a"]', 422, None, "body"),
    "invalid UTF-8": (b'{"model": "t", "segments": ["\xff\xfe abc"]}', 422, None, "UTF-8"),
    "segments a string": (json.dumps({"model": "t", "segments": "a"}).encode(), 422, "segments", "list"),
    "a segment a number": (json.dumps({"model": "t", "segments": [3]}).encode(), 422, "segments.0", "string"),
    "beam a string": (
        json.dumps({"model": "t", "segments": ["a"], "beam_size": "4"}).encode(),
        422,
        "beam_size",
        "integer",
    ),
    "empty segments": (json.dumps({"model": "t", "segments": []}).encode(), 422, "segments", "at least 1"),
    "no model": (json.dumps({"segments": ["a"]}).encode(), 422, "model", "required"),
    "unknown field": (
        json.dumps({"model": "t", "segments": ["a"], "beam": 4}).encode(),
        422,
        "beam",
        "unknown",
    ),
    "unknown segment field": (
        json.dumps({"model": "t", "segments": [{"text": "a", "prefixx": "b"}]}).encode(),
        422,
        "segments.0.prefixx",
        "unknown",
    ),
    "negative beam": (
        json.dumps({"model": "t", "segments": ["a"], "beam_size": -1}).encode(),
        422,
        "beam_size",
        "beam_size must be an integer >= 1",
    ),
    "a beam of 100,000": (
        json.dumps({"model": "t", "segments": ["a"], "beam_size": 100_000}).encode(),
        422,
        "beam_size",
        "less than or equal to 64",
    ),
    "n_best above the beam": (
        json.dumps({"model": "t", "segments": ["a"], "beam_size": 2, "n_best": 3}).encode(),
        422,
        "n_best",
        "n_best must be <= beam_size",
    ),
    "NaN": (b'{"model": "t", "segments": ["a"], "length_penalty": NaN}', 422, "length_penalty", "finite"),
    "negative seed": (json.dumps({"model": "t", "segments": ["a"], "seed": -1}).encode(), 422, "seed", ""),
    "unknown model": (
        json.dumps({"model": "x", "segments": ["a"]}).encode(),
        404,
        "model",
        "the models are: t",
    ),
    "10,000 segments": (
        json.dumps({"model": "t", "segments": ["a b"] * 10_000}).encode(),
        413,
        None,
        "segments",
    ),
    "1 MB segment": (
        json.dumps({"model": "t", "segments": ["x" * 1_000_000]}).encode(),
        413,
        None,
        "characters",
    ),
    "a body past the size bound": (
        json.dumps({"model": "t", "segments": ["x" * 2_000_000]}).encode(),
        413,
        None,
        "larger",
    ),
    "too many characters": (
        json.dumps({"model": "t", "segments": ["x" * 30_000]}).encode(),
        413,
        None,
        "characters",
    ),
}


def test_each_bad_body_gets_its_status_and_a_json_error(server: str, translator: Translator) -> None:
    with HealthWatch(server), httpx.Client(base_url=server, timeout=60) as client:
        for name, (raw, status, field, words) in BAD_BODIES.items():
            response = client.post("/v1/translate", content=raw, headers={"Content-Type": "application/json"})
            error = error_of(response, status)
            assert error.get("field") == field or field is None, (name, error)
            assert words in error["message"], (name, error)
            good_request_is_correct(client, translator) if name in ("invalid UTF-8", "1 MB segment") else None
        good_request_is_correct(client, translator)


def test_clients_that_disconnect(server: str, translator: Translator) -> None:
    """Mid-body (a Content-Length never delivered) and while its translation is queued or running."""
    address = urlparse(server)
    lines = source_lines(60, seed=3)
    heavy = json.dumps({"model": "t", "segments": lines, "beam_size": 4}).encode()
    with HealthWatch(server), httpx.Client(base_url=server, timeout=60) as client:
        for body, send in ((heavy, heavy[:100]), (heavy, heavy), (heavy, heavy)):
            with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
                head = "POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + send)
                time.sleep(0.1)
        good_request_is_correct(client, translator)


def test_a_missed_deadline_is_504_and_its_queued_work_is_skipped(
    checkpoint: Path, translator: Translator
) -> None:
    """Three long requests (256 segments, beam 16, 60 tokens at least: seconds each) with a 0.3 s deadline:
    all three 504; the first one's call finishes unread, the two queued behind it never reach the model."""
    lines = source_lines(256, seed=4)
    values = {"batching": {"timeout_s": 0.3, "max_wait_ms": 0, "max_batch_tokens": 1}}
    app = create_app(settings({"t": str(checkpoint)}, **values), {"t": translator})
    heavy = {"model": "t", "segments": lines, "beam_size": 16, "min_len": 60, "max_len_b": 80}
    with serving(app) as url, HealthWatch(url), httpx.Client(base_url=url, timeout=60) as client:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: client.post("/v1/translate", json=heavy), range(3)))
        for response in answers:
            assert "timeout_s=0.3" in error_of(response, 504)["message"]
        deadline = time.monotonic() + 60
        while True:  # the call under way finishes (unread): the worker takes the next request
            line = source_lines(1)[0]
            response = client.post("/v1/translate", json={"model": "t", "segments": [line]})
            if response.status_code == 200:
                break
            assert response.status_code == 504 and time.monotonic() < deadline
        assert response.json()["translations"][0]["translation"] == translator.translate([line])[0].text
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        segments = [s.value for s in families["aiayn_batch_segments"].samples if s.name.endswith("_sum")]
        assert 256 < segments[0] < 2 * 256  # one heavy call, then single lines


def test_200_requests_past_the_queue_bound_get_429(checkpoint: Path, translator: Translator) -> None:
    lines = source_lines(16, seed=6)
    values = {"batching": {"queue_size": 4, "max_batch_tokens": 1, "max_wait_ms": 0}}  # a request a call
    app = create_app(settings({"t": str(checkpoint)}, **values), {"t": translator})
    want = [t.text for t in translator.translate(lines, beam_size=4)]
    with serving(app) as url, HealthWatch(url), httpx.Client(base_url=url, timeout=120) as client:
        barrier = threading.Barrier(32, timeout=30)

        def send(i: int) -> httpx.Response:
            if i < 32:
                barrier.wait()
            return client.post("/v1/translate", json={"model": "t", "segments": lines, "beam_size": 4})

        with ThreadPoolExecutor(32) as pool:
            responses = list(pool.map(send, range(204)))
        full = [r for r in responses if r.status_code == 429]
        assert len(full) >= 100, [r.status_code for r in responses]
        for response in full:
            assert int(response.headers["retry-after"]) >= 1
            assert "requests are waiting" in error_of(response, 429)["message"]
        for response in responses:
            if response.status_code != 429:
                assert response.status_code == 200, response.text
                assert [t["translation"] for t in response.json()["translations"]] == want
        good_request_is_correct(client, translator)
