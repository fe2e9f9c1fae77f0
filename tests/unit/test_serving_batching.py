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
from transformer.serving.batching import Job, ModelWorker, QueueFull, ShuttingDown
from transformer.serving.config import BatchingSettings
from transformer.serving.metrics import Metrics

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


def _calls(metrics: Metrics, model_id: str) -> tuple[float, float]:
    """(model calls, requests in them) of `model_id`'s worker."""
    samples = {
        s.name: s.value for s in metrics.batch_requests.collect()[0].samples if s.labels["model"] == model_id
    }
    return samples["aiayn_batch_requests_count"], samples["aiayn_batch_requests_sum"]


def test_the_worker_keeps_the_token_budget_and_groups_by_settings(translator: Translator) -> None:
    """Requests queued before the worker starts: a budget of two requests' tokens takes two, then the third
    (carried over); requests of two decoding settings in one batch are two calls."""
    lines = source_lines(6)
    cost = Job([lines[0]]).cost
    metrics = Metrics()
    greedy, beam = translator.settings(), translator.settings(beam_size=4)

    limits = BatchingSettings(max_batch_tokens=Job(lines[:2]).cost, max_wait_ms=0)
    worker = ModelWorker("budget", translator, limits, metrics)
    jobs = [Job([line], greedy) for line in lines[:3]]
    assert jobs[0].cost == cost and sum(j.cost for j in jobs[:2]) <= limits.max_batch_tokens < 3 * cost
    futures = [worker.submit(job) for job in jobs]
    worker.start()
    outputs = [future.result(timeout=60) for future in futures]
    worker.stop()
    assert [o[0].text for o in outputs] == [t.text for t in translator.translate(lines[:3])]
    assert _calls(metrics, "budget") == (2.0, 3.0)

    worker = ModelWorker("groups", translator, BatchingSettings(max_wait_ms=0), metrics)
    jobs = [Job([line], beam if i % 2 else greedy) for i, line in enumerate(lines[:4])]
    futures = [worker.submit(job) for job in jobs]
    worker.start()
    outputs = [future.result(timeout=60) for future in futures]
    worker.stop()
    assert _calls(metrics, "groups") == (2.0, 4.0)
    for i, output in enumerate(outputs):
        assert output[0].text == translator.translate([lines[i]], beam_size=4 if i % 2 else 1)[0].text


def test_a_full_queue_refuses_and_a_stopped_worker_answers_what_waits(translator: Translator) -> None:
    worker = ModelWorker("full", translator, BatchingSettings(queue_size=2), Metrics())
    waiting = [worker.submit(Job(["a"], translator.settings())) for _ in range(2)]
    with pytest.raises(QueueFull, match="2 requests are waiting for model full"):
        worker.submit(Job(["a"], translator.settings()))
    worker._stopping.set()  # stopped before it took them: they fail as "shutting down" (503), none hangs
    worker.start()
    worker.stop()
    for future in waiting:
        with pytest.raises(ShuttingDown):
            future.result(timeout=10)
