"""Issue 65 item 3 on the server: `target_lang` per request and per segment of /v1/translate, answered as
`Translator.translate` answers each segment alone (also when requests for different languages share a
model call of dynamic batching), /v1/models listing a model's target languages, and a language the model
does not know (or none, for a multilingual model) a 422 naming the field and listing the valid ones."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.helpers.multilingual import SENTENCES, multilingual_checkpoint
from tests.helpers.serving import serving, settings
from transformer.inference import Segment, Translator
from transformer.serving.app import create_app
from transformer.serving.config import ServeConfigError, ServeSettings
from transformer.serving.models import check_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    multi, twin = multilingual_checkpoint(tmp_path_factory.mktemp("multilingual"))
    return {"multi": str(multi), "twin": str(twin)}


@pytest.fixture(scope="module")
def models(paths: dict[str, str]) -> dict[str, Translator]:
    return {name: Translator.from_checkpoint(path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def client(paths: dict[str, str], models: dict[str, Translator]):
    with TestClient(create_app(settings(paths), models)) as test_client:
        yield test_client


def alone(translator: Translator, text: str, lang: str | None) -> str:
    return translator.translate([Segment(text, target_lang=lang)])[0].text


def texts(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [t["translation"] for t in response.json()["translations"]]


def test_models_list_their_target_languages(client: TestClient) -> None:
    listed = {m["id"]: m for m in client.get("/v1/models").json()["models"]}
    assert listed["multi"]["target_languages"] == ["de", "fr"] and listed["multi"]["multilingual"] is True
    assert listed["twin"]["target_languages"] == ["de"] and listed["twin"]["multilingual"] is False


def test_request_and_segment_languages(client: TestClient, models: dict[str, Translator]) -> None:
    multi = models["multi"]
    body = {"model": "multi", "segments": SENTENCES[:3], "target_lang": "fr"}
    assert texts(client.post("/v1/translate", json=body)) == [alone(multi, s, "fr") for s in SENTENCES[:3]]
    segments = [SENTENCES[0], {"text": SENTENCES[1], "target_lang": "de"}, {"text": SENTENCES[2]}]
    body = {"model": "multi", "segments": segments, "target_lang": "fr"}
    expected = [
        alone(multi, SENTENCES[0], "fr"),
        alone(multi, SENTENCES[1], "de"),
        alone(multi, SENTENCES[2], "fr"),
    ]
    assert texts(client.post("/v1/translate", json=body)) == expected
    body = {"model": "multi", "segments": [{"text": SENTENCES[3], "target_lang": "de"}]}  # no request default
    assert texts(client.post("/v1/translate", json=body)) == [alone(multi, SENTENCES[3], "de")]


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        (
            {"segments": SENTENCES[:1]},
            "target_lang",
            "this model is multilingual; choose a target language: de, fr",
        ),
        (
            {"segments": SENTENCES[:1], "target_lang": "es"},
            "target_lang",
            "unknown target language 'es'; this model knows de, fr",
        ),
        (
            {"segments": ["a", {"text": "b", "target_lang": "it"}], "target_lang": "de"},
            "segments[1].target_lang",
            "unknown target language 'it'",
        ),
        ({"segments": ["a", {"text": "b"}]}, "target_lang", "choose a target language: de, fr"),
        ({"segments": ["a"], "target_lang": 5}, "target_lang", "string"),
    ],
)
def test_bad_languages_are_422_naming_the_field(
    client: TestClient, body: dict, field: str, message: str
) -> None:
    response = client.post("/v1/translate", json={"model": "multi", **body})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and message in error["message"], error


def test_a_bilingual_model_takes_its_target_and_refuses_another(
    client: TestClient, models: dict[str, Translator]
) -> None:
    plain = texts(client.post("/v1/translate", json={"model": "twin", "segments": SENTENCES[:2]}))
    same = client.post(
        "/v1/translate", json={"model": "twin", "segments": SENTENCES[:2], "target_lang": "de"}
    )
    assert texts(same) == plain == [alone(models["twin"], s, None) for s in SENTENCES[:2]]
    response = client.post("/v1/translate", json={"model": "twin", "segments": ["a"], "target_lang": "fr"})
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "target_lang"
    assert "'fr' given, but this model translates into 'de' only" in response.json()["error"]["message"]


def test_requests_for_different_languages_batched_together(
    paths: dict[str, str], models: dict[str, Translator], monkeypatch: pytest.MonkeyPatch
) -> None:
    multi = models["multi"]
    langs = ["de", "fr"]
    requests = [(SENTENCES[i % len(SENTENCES)], langs[i % 2]) for i in range(16)]
    expected = [alone(multi, text, lang) for text, lang in requests]
    calls: list[set[str | None]] = []  # the target languages of each model call
    translate = multi.translate

    def recording(inputs, *args, **kwargs):
        calls.append({item.target_lang for item in inputs})
        return translate(inputs, *args, **kwargs)

    monkeypatch.setattr(multi, "translate", recording)
    app = create_app(settings({"multi": paths["multi"]}, batching={"max_wait_ms": 50}), {"multi": multi})
    start = threading.Barrier(len(requests), timeout=60)
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as client:

        def send(request: tuple[str, str]) -> httpx.Response:
            start.wait()
            return client.post(
                "/v1/translate", json={"model": "multi", "segments": [request[0]], "target_lang": request[1]}
            )

        with ThreadPoolExecutor(len(requests)) as pool:
            responses = list(pool.map(send, requests))
    assert [texts(response)[0] for response in responses] == expected
    assert len(calls) < len(requests) and {"de", "fr"} in calls  # a model call held both languages


def test_a_served_default_language_for_requests_naming_none(
    paths: dict[str, str], models: dict[str, Translator]
) -> None:
    """`models[i].target_lang`: the language of requests and segments that name none; theirs still win."""
    multi = models["multi"]
    entry = {"id": "multi", "checkpoint": paths["multi"], "target_lang": "fr"}
    with TestClient(create_app(ServeSettings.from_dict({"models": [entry]}), {"multi": multi})) as client:
        listed = client.get("/v1/models").json()["models"][0]
        assert listed["target_lang"] == "fr" and listed["target_languages"] == ["de", "fr"]
        segments = [SENTENCES[0], {"text": SENTENCES[1], "target_lang": "de"}]
        assert texts(client.post("/v1/translate", json={"model": "multi", "segments": segments})) == [
            alone(multi, SENTENCES[0], "fr"),
            alone(multi, SENTENCES[1], "de"),
        ]
        body = {"model": "multi", "segments": SENTENCES[2:3], "target_lang": "de"}
        assert texts(client.post("/v1/translate", json=body)) == [alone(multi, SENTENCES[2], "de")]


@pytest.mark.parametrize(
    ("model", "lang", "message"),
    [
        ("multi", "es", r"^models\[0\]\.target_lang: unknown target language 'es'; this model knows de, fr$"),
        ("twin", "fr", r"^models\[0\]\.target_lang: 'fr' given, but this model translates into 'de' only"),
    ],
)
def test_a_served_default_the_model_cannot_translate_into_stops_the_start(
    paths: dict[str, str], models: dict[str, Translator], model: str, lang: str, message: str
) -> None:
    entry = {"id": model, "checkpoint": paths[model], "target_lang": lang}
    with pytest.raises(ServeConfigError, match=message):
        check_model(ServeSettings.from_dict({"models": [entry]}).models[0], models[model])
    assert (
        check_model(
            ServeSettings.from_dict({"models": [{**entry, "target_lang": "de"}]}).models[0], models[model]
        ).target_lang
        == "de"
    )


@pytest.mark.parametrize("value", [5, "", "  ", ["de"]])
def test_a_bad_served_default_is_refused_by_the_config(paths: dict[str, str], value: object) -> None:
    with pytest.raises(ServeConfigError, match=r"^models\[0\]\.target_lang must be a language code"):
        ServeSettings.from_dict({"models": [{"id": "m", "checkpoint": paths["multi"], "target_lang": value}]})
