"""Dynamic batching on a real tiny checkpoint behind uvicorn on 127.0.0.1: 64 concurrent requests (greedy
and beam 4) answered exactly as `evaluate.py translate.input=FILE` translates the same lines, with fewer
model calls than requests; a seeded sampling request gives the same output whatever else arrives; a
failing group fails only its own requests, and the worker goes on."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.serving import evaluate_translations, served_run, serving, settings, source_lines
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


def model_calls(client: httpx.Client) -> tuple[float, float]:
    """(model calls, requests in them) from /metrics."""
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    samples = {
        s.name: s.value
        for s in families["aiayn_batch_requests"].samples
        if s.name.endswith(("_count", "_sum"))
    }
    return samples["aiayn_batch_requests_count"], samples["aiayn_batch_requests_sum"]


@pytest.mark.parametrize("beam", [1, 4])
def test_64_concurrent_requests_equal_evaluate(
    checkpoint: Path, translator: Translator, tmp_path: Path, beam: int
) -> None:
    lines = source_lines(80)
    expected = evaluate_translations(checkpoint, lines, tmp_path, f"decode.beam_size={beam}")
    assert len(set(expected)) > 60 and all(expected), expected  # sentences: a comparison that can fail
    # request i: lines i .. i + i % 3 (one to three segments), so requests overlap and differ in size
    requests = [list(range(i, i + 1 + i % 3)) for i in range(64)]
    app = create_app(settings({"t": str(checkpoint)}, batching={"max_wait_ms": 20}), {"t": translator})
    start = threading.Barrier(64, timeout=60)

    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as client:

        def send(indices: list[int]) -> httpx.Response:
            start.wait()  # all 64 at once
            body = {"model": "t", "segments": [lines[i] for i in indices], "beam_size": beam}
            return client.post("/v1/translate", json=body)

        with ThreadPoolExecutor(64) as pool:
            responses = list(pool.map(send, requests))
        for indices, response in zip(requests, responses, strict=True):
            assert response.status_code == 200, response.text
            got = [t["translation"] for t in response.json()["translations"]]
            assert got == [expected[i] for i in indices]
        calls, batched = model_calls(client)
    assert batched == 64 and calls < 64 and batched / calls > 1, (calls, batched)


def test_a_seeded_sample_is_the_same_whatever_arrives_with_it(
    checkpoint: Path, translator: Translator
) -> None:
    lines = source_lines(4)
    seeded = {"model": "t", "segments": lines, "sampling": True, "seed": 1234, "n_best": 2}
    alone = translator.translate(
        lines, translator.settings(search="sample", n_best=2), generator=torch.Generator().manual_seed(1234)
    )
    want = [[h.text for h in t.hypotheses] for t in alone]
    app = create_app(settings({"t": str(checkpoint)}, batching={"max_wait_ms": 30}), {"t": translator})
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        others = [{"model": "t", "segments": lines[:2], "sampling": True}] * 6 + [seeded] * 3
        with ThreadPoolExecutor(9) as pool:
            responses = list(pool.map(lambda body: client.post("/v1/translate", json=body), others))
        assert all(r.status_code == 200 for r in responses)
        for response in responses[6:]:
            assert [[h["translation"] for h in t["n_best"]] for t in response.json()["translations"]] == want


class FailingOnMarker(Translator):
    """The real translator, whose model call fails when a segment reads "boom" (a model error on demand)."""

    def translate(self, texts, settings=None, **kwargs):
        if "boom" in [getattr(t, "text", t) for t in texts]:
            raise RuntimeError("the model broke on purpose")
        return super().translate(texts, settings, **kwargs)


def test_a_failing_group_fails_only_its_requests(checkpoint: Path, translator: Translator) -> None:
    model = FailingOnMarker.from_checkpoint(checkpoint)
    lines = source_lines(6)
    app = create_app(settings({"t": str(checkpoint)}, batching={"max_wait_ms": 200}), {"t": model})
    bodies = [
        {"model": "t", "segments": ["boom", lines[0]]},  # greedy: fails with its group
        {"model": "t", "segments": lines[1:3], "beam_size": 4},  # another group: untouched
        {"model": "t", "segments": [{"text": lines[3], "constraints": ["Auto✈"]}], "beam_size": 4},  # refused
        {"model": "t", "segments": lines[4:6], "beam_size": 4},
    ]
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        barrier = threading.Barrier(len(bodies), timeout=30)

        def send(body: dict) -> httpx.Response:
            barrier.wait()
            return client.post("/v1/translate", json=body)

        with ThreadPoolExecutor(len(bodies)) as pool:
            failed, good, refused, other = pool.map(send, bodies)
        assert failed.status_code == 500 and "broke on purpose" in failed.json()["error"]["message"]
        assert refused.status_code == 422 and "<unk>" in refused.json()["error"]["message"]
        for response, segments in ((good, lines[1:3]), (other, lines[4:6])):
            assert response.status_code == 200, response.text
            want = [t.text for t in translator.translate(segments, beam_size=4)]
            assert [t["translation"] for t in response.json()["translations"]] == want
        after = client.post("/v1/translate", json={"model": "t", "segments": [lines[0]]})
        assert after.json()["translations"][0]["translation"] == translator.translate([lines[0]])[0].text
