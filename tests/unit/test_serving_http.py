"""The server's endpoints on a real tiny checkpoint of each task, through FastAPI's TestClient: /health,
/ready (503 while a model loads, 200 after), /v1/models, translate and classify, the API key, CORS, the
page, /metrics in Prometheus' text format, and the JSON error body of every refusal."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import trained
from tests.helpers.serving import settings, source_lines
from transformer.inference import Classifier, Translator
from transformer.serving.app import create_app
from transformer.serving.config import ServeConfigError, ServeSettings
from transformer.serving.models import check_model, load_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

translation_run = trained.translation_run  # the session's tiny runs (tests/helpers/trained.py)
classification_run = trained.classification_run


@pytest.fixture(scope="module")
def paths(translation_run: Path, classification_run: Path) -> dict[str, str]:
    return {
        "en-de": str(translation_run / "checkpoints" / "last.ckpt"),
        "sst": str(classification_run / "checkpoints" / "last.ckpt"),
    }


@pytest.fixture(scope="module")
def models(paths: dict[str, str]) -> dict[str, object]:
    return {
        "en-de": Translator.from_checkpoint(paths["en-de"]),
        "sst": Classifier.from_checkpoint(paths["sst"]),
    }


@pytest.fixture(scope="module")
def client(paths: dict[str, str], models: dict[str, object]):
    with TestClient(create_app(settings(paths), models)) as test_client:
        yield test_client


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and body["error"]["status"] == status
    assert body["error"]["message"] and "\n" not in body["error"]["message"]
    return body["error"]


def test_health_ready_and_models(client: TestClient, models: dict[str, object]) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready", "models": ["en-de", "sst"]}
    listed = {m["id"]: m for m in client.get("/v1/models").json()["models"]}
    translation, classification = listed["en-de"], listed["sst"]
    assert translation["task"] == "translation" and classification["task"] == "classification"
    for entry, model in ((translation, models["en-de"]), (classification, models["sst"])):
        assert entry["backend"] == "torch" and entry["device"] == "cpu"
        assert entry["parameters"] == sum(p.numel() for p in model.model.parameters()) > 0
        assert set(entry["languages"]) == {"source", "target"}
    assert translation["decoding"]["beam_size"] == models["en-de"].defaults.beam_size
    assert translation["decoding"]["max_len_b"] == models["en-de"].defaults.max_len_b
    assert classification["labels"] == list(models["sst"].labels) and "decoding" not in classification
    assert "labels" not in translation


def test_translate_and_classify_give_the_models_outputs(
    client: TestClient, models: dict[str, object]
) -> None:
    lines = source_lines(3)
    response = client.post(
        "/v1/translate", json={"model": "en-de", "segments": lines, "beam_size": 4, "n_best": 2}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    expected = models["en-de"].translate(lines, beam_size=4, n_best=2)
    assert body["model"] == "en-de" and body["time_ms"] > 0
    for got, want in zip(body["translations"], expected, strict=True):
        assert got["translation"] == want.text and got["score"] == pytest.approx(want.score, abs=1e-5)
        assert [h["translation"] for h in got["n_best"]] == [h.text for h in want.hypotheses]
        assert len(got["n_best"]) == 2 and got["unsatisfiable"] is False
    texts = ["a good film", "a dull and boring film"]
    body = client.post("/v1/classify", json={"model": "sst", "segments": texts}).json()
    for got, want in zip(body["predictions"], models["sst"].predict(texts), strict=True):
        assert got["label"] == want.label
        assert got["probabilities"] == pytest.approx(want.probabilities)
        assert sum(got["probabilities"].values()) == pytest.approx(1.0)


def test_per_segment_prefix(client: TestClient, models: dict[str, object]) -> None:
    segment = {"text": source_lines(1)[0], "prefix": "Gestern"}
    body = client.post("/v1/translate", json={"model": "en-de", "segments": [segment]}).json()
    from transformer.inference import Segment

    want = models["en-de"].translate([Segment(segment["text"], prefix="Gestern")])[0]
    assert body["translations"][0]["translation"] == want.text and want.text.startswith("Gestern")


def test_a_model_of_the_other_task_and_an_unknown_model(client: TestClient) -> None:
    wrong = error_of(client.post("/v1/classify", json={"model": "en-de", "segments": ["a"]}), 422)
    assert "translation model" in wrong["message"] and "/v1/translate" in wrong["message"]
    assert wrong["field"] == "model"
    wrong = error_of(client.post("/v1/translate", json={"model": "sst", "segments": ["a"]}), 422)
    assert "/v1/classify" in wrong["message"]
    unknown = error_of(client.post("/v1/translate", json={"model": "fr-en", "segments": ["a"]}), 404)
    assert "'fr-en'" in unknown["message"] and "en-de, sst" in unknown["message"]


def test_routing_errors_are_json_too(client: TestClient) -> None:
    assert "/nowhere" in error_of(client.get("/nowhere"), 404)["message"]
    assert "GET" in error_of(client.get("/v1/translate"), 405)["message"]
    assert (
        client.get("/docs").status_code == 200
        and "/v1/translate" in client.get("/openapi.json").json()["paths"]
    )


def test_metrics_parse_and_count_requests(client: TestClient) -> None:
    client.get("/health")
    client.post("/v1/translate", json={"model": "nope", "segments": ["a"]})
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    requests = {
        (s.labels["endpoint"], s.labels["status"]): s.value
        for s in families["aiayn_requests"].samples
        if s.name == "aiayn_requests_total"
    }
    assert requests[("/health", "200")] >= 1 and requests[("/v1/translate", "404")] >= 1
    assert {
        "aiayn_request_seconds",
        "aiayn_batch_segments",
        "aiayn_batch_requests",
        "aiayn_queue_depth",
    } <= set(families)
    depths = {s.labels["model"]: s.value for s in families["aiayn_queue_depth"].samples}
    assert depths == {"en-de": 0.0, "sst": 0.0}


def test_the_api_key(paths: dict[str, str], models: dict[str, object]) -> None:
    app = create_app(settings(paths, api_key="s3cret"), models)
    body = {"model": "sst", "segments": ["a good film"]}
    with TestClient(app) as client:
        for path in ("/v1/models", "/metrics"):
            response = client.get(path)
            assert response.headers["www-authenticate"] == "Bearer"
            assert "Authorization: Bearer" in error_of(response, 401)["message"]
        wrong = client.post("/v1/classify", json=body, headers={"Authorization": "Bearer s3cre"})
        assert "wrong" in error_of(wrong, 401)["message"]
        assert client.post("/v1/classify", json=body, headers={"Authorization": "s3cret"}).status_code == 401
        good = client.post("/v1/classify", json=body, headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200 and good.json()["predictions"]
        for path in ("/health", "/ready", "/docs", "/openapi.json"):
            assert client.get(path).status_code == 200, path


def test_cors_only_when_configured(paths: dict[str, str], models: dict[str, object]) -> None:
    preflight = {"Origin": "https://example.org", "Access-Control-Request-Method": "POST"}
    with TestClient(create_app(settings(paths), models)) as client:
        assert (
            "access-control-allow-origin"
            not in client.get("/health", headers={"Origin": "https://example.org"}).headers
        )
        assert client.options("/v1/translate", headers=preflight).status_code in (404, 405)
    app = create_app(settings(paths, cors_origins=["https://example.org"], api_key="k"), models)
    with TestClient(app) as client:
        response = client.options("/v1/translate", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://example.org"
        other = client.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_the_page(paths: dict[str, str], models: dict[str, object], tmp_path: Path) -> None:
    with TestClient(create_app(settings(paths), models, page=tmp_path / "absent.html")) as client:
        assert "page" in error_of(client.get("/"), 404)["message"]
    page = tmp_path / "page.html"
    page.write_text("<!doctype html><title>aiayn</title>", encoding="utf-8")
    with TestClient(create_app(settings(paths), models, page=page)) as client:
        response = client.get("/")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        assert response.text == page.read_text()


def test_ready_is_503_while_a_model_loads(paths: dict[str, str], models: dict[str, object]) -> None:
    """A real checkpoint whose loading waits for the test: /ready 503 naming it, /health 200, its requests
    503; then /ready 200 and it translates."""
    go = threading.Event()

    def slow_load(entry):
        assert go.wait(60), "the test never let the model load"
        return load_model(entry)

    app = create_app(settings(paths), {"sst": models["sst"]}, load=slow_load)
    with TestClient(app) as client:
        assert error_of(client.get("/ready"), 503)["message"] == "loading: en-de"
        assert client.get("/health").status_code == 200
        waiting = client.post("/v1/translate", json={"model": "en-de", "segments": ["a"]})
        assert "not loaded yet" in error_of(waiting, 503)["message"]
        assert [m["id"] for m in client.get("/v1/models").json()["models"]] == ["sst"]
        go.set()
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load within 60 s"
            time.sleep(0.05)
        line = source_lines(1)[0]
        body = client.post("/v1/translate", json={"model": "en-de", "segments": [line]}).json()
        assert body["translations"][0]["translation"] == models["en-de"].translate([line])[0].text


def test_a_model_that_fails_to_load_keeps_ready_at_503(
    paths: dict[str, str], models: dict[str, object], tmp_path: Path
) -> None:
    missing = str(tmp_path / "gone.ckpt")
    app = create_app(settings({**paths, "en-de": missing}), {"sst": models["sst"]})
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while "failed" not in (message := error_of(client.get("/ready"), 503)["message"]):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert "en-de" in message and "gone.ckpt" in message
        assert client.post("/v1/classify", json={"model": "sst", "segments": ["a"]}).status_code == 200


@pytest.mark.parametrize("name", ["decoding", "target_lang"])
def test_a_classifier_with_translation_settings_stops_the_start(
    paths: dict[str, str], models: dict[str, object], name: str
) -> None:
    value = {"beam_size": 2} if name == "decoding" else "de"
    entry = {"id": "sst", "checkpoint": paths["sst"], name: value}
    with pytest.raises(ServeConfigError, match=rf"^models\[0\]\.{name}: sst is a classification model"):
        check_model(ServeSettings.from_dict({"models": [entry]}).models[0], models["sst"])
