"""The server's CTranslate2 backend (issue 64, item 5) on a tiny trained model that writes varied sentences
(tests/helpers/serving.py's `served_run`): the same checkpoint served twice, `backend: torch` and
`backend: ctranslate2`, answers the same greedy translations (and scores) for the run's test split, each
equal to `Translator.translate`; int8 runs and answers sentences; /v1/models names the backend and the
compute type; what CTranslate2 cannot do is refused at start-up (the model's defaults: one `error:` line
naming the `models[i].decoding.<key>` to set) or per request (422 naming the option)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import ctranslate2
import pytest
from fastapi.testclient import TestClient
from omegaconf import OmegaConf

from data.synthetic import make_synthetic_splits
from tests.helpers import trained
from tests.helpers.cli import run_script
from tests.helpers.repo import REPO_ROOT, cli_env
from tests.helpers.serving import free_port, served_run
from transformer.inference import CTranslate2Translator, Translator
from transformer.serving.app import create_app
from transformer.serving.config import ServeConfigError, ServeSettings
from transformer.serving.models import check_model, load_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

served_run = served_run  # a session fixture (tests/helpers/serving.py)
classification_run = trained.classification_run


@pytest.fixture(scope="module")
def checkpoint(served_run: Path) -> str:
    return str(served_run / "checkpoints" / "last.ckpt")


@pytest.fixture(scope="module")
def test_sources(served_run: Path) -> list[str]:
    """The source side of the run's own test split (its seed and split sizes, from its Hydra config)."""
    cfg = OmegaConf.load(served_run / ".hydra" / "config.yaml")
    sizes = OmegaConf.to_container(cfg.data.synthetic_sizes)
    assert cfg.data.source == "synthetic" and sizes["test"] >= 30, sizes
    return list(make_synthetic_splits(int(cfg.seed), sizes)["test"][0])


def serve_settings(checkpoint: str, cache: Path, **extra: dict) -> ServeSettings:
    """torch, ctranslate2 (default compute type) and ctranslate2 int8 models of the same checkpoint."""
    return ServeSettings.from_dict(
        {
            "models": [
                {"id": "torch", "checkpoint": checkpoint},
                {"id": "ct2", "checkpoint": checkpoint, "backend": "ctranslate2", "cache_dir": str(cache)},
                {
                    "id": "ct2-int8",
                    "checkpoint": checkpoint,
                    "backend": "ctranslate2",
                    "compute_type": "int8",
                    "cache_dir": str(cache),
                },
            ],
            **extra,
        }
    )


@pytest.fixture(scope="module")
def client(checkpoint: str, tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("ct2-cache")
    config = serve_settings(checkpoint, cache)
    models = {entry.id: load_model(entry) for entry in config.models}
    assert isinstance(models["ct2"], CTranslate2Translator) and isinstance(models["torch"], Translator)
    # one conversion, named by the checkpoint's digest, shared by both CTranslate2 models
    assert models["ct2"].directory == models["ct2-int8"].directory and models["ct2"].directory.parent == cache
    with TestClient(create_app(config, models)) as test_client:
        yield test_client


def translate(client: TestClient, model: str, segments: list, **options) -> list[dict]:
    response = client.post("/v1/translate", json={"model": model, "segments": segments, **options})
    assert response.status_code == 200, response.text
    return response.json()["translations"]


def refusal(client: TestClient, model: str, segments: list, **options) -> dict:
    response = client.post("/v1/translate", json={"model": model, "segments": segments, **options})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["status"] == 422 and "\n" not in error["message"]
    return error


def test_models_names_the_backend_and_compute_type(client: TestClient) -> None:
    listed = {m["id"]: m for m in client.get("/v1/models").json()["models"]}
    assert listed["torch"]["backend"] == "torch" and listed["torch"]["compute_type"] is None
    assert listed["ct2"]["backend"] == "ctranslate2" and listed["ct2"]["compute_type"] == "default"
    assert listed["ct2-int8"]["backend"] == "ctranslate2" and listed["ct2-int8"]["compute_type"] == "int8"
    for entry in listed.values():
        assert entry["device"] == "cpu" and entry["task"] == "translation"
        assert entry["languages"] == listed["torch"]["languages"]
        assert entry["parameters"] == listed["torch"]["parameters"] > 0
        assert entry["decoding"] == listed["torch"]["decoding"]  # the checkpoint's own: greedy


def test_greedy_translations_equal_the_torch_backend_on_the_test_split(
    client: TestClient, checkpoint: str, test_sources: list[str]
) -> None:
    reference = Translator.from_checkpoint(checkpoint).translate(test_sources, beam_size=1)
    texts = [t.text for t in reference]
    assert len(set(texts)) > 0.7 * len(texts) and all(texts), texts  # varied sentences: it can fail
    torch_out = translate(client, "torch", test_sources)
    ct2_out = translate(client, "ct2", test_sources)
    assert [t["translation"] for t in torch_out] == texts
    assert [t["translation"] for t in ct2_out] == texts
    for mine, theirs, expected in zip(ct2_out, torch_out, reference):
        assert mine["score"] == pytest.approx(expected.score, abs=1e-4)
        assert mine["score"] == pytest.approx(theirs["score"], abs=1e-4)
        assert len(mine["n_best"]) == 1 and mine["unsatisfiable"] is False


def test_beam_search_at_length_penalty_0_and_prefixes_equal_the_torch_backend(
    client: TestClient, test_sources: list[str]
) -> None:
    sources = test_sources[:12]
    options = {"beam_size": 4, "length_penalty": 0}
    expected = translate(client, "torch", sources, **options)
    got = translate(client, "ct2", sources, **options)
    assert [t["translation"] for t in got] == [t["translation"] for t in expected]
    assert [t["score"] for t in got] == pytest.approx([t["score"] for t in expected], abs=1e-4)
    # a target prefix per segment (greedy)
    first_words = [t["translation"].split()[0] for t in expected]
    segments = [{"text": s, "prefix": w} for s, w in zip(sources, first_words)]
    prefixed = translate(client, "ct2", segments)
    assert [t["translation"] for t in prefixed] == [
        t["translation"] for t in translate(client, "torch", segments)
    ]
    assert all(t["translation"].startswith(w) for t, w in zip(prefixed, first_words))


def test_int8_answers_sentences(client: TestClient, test_sources: list[str]) -> None:
    full = [t["translation"] for t in translate(client, "ct2", test_sources)]
    int8 = translate(client, "ct2-int8", test_sources)
    texts = [t["translation"] for t in int8]
    assert all(len(text.split()) >= 2 for text in texts), texts
    assert all(t["score"] is not None and t["score"] < 0 for t in int8)
    same = sum(a == b for a, b in zip(texts, full))
    assert same >= len(texts) // 2, f"int8 agrees with float32 on {same} of {len(texts)} sentences"
    # sampling on int8 too: n_best independent samples, best first
    sampled = translate(client, "ct2-int8", test_sources[:3], sampling=True, top_k=5, n_best=3)
    for translation in sampled:
        scores = [h["score"] for h in translation["n_best"]]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True)


def test_requests_ctranslate2_cannot_decode_are_422_naming_the_option(
    client: TestClient, test_sources: list[str]
) -> None:
    sources = test_sources[:2]
    # the checkpoint's length penalty (0.6) with a beam: the request's beam_size is at fault
    error = refusal(client, "ct2", sources, beam_size=4)
    assert error["field"] == "beam_size" and "length_penalty=0.6" in error["message"]
    error = refusal(client, "ct2", sources, beam_size=4, length_penalty=0, n_best=2)
    assert error["field"] == "n_best"
    assert refusal(client, "ct2", sources, temperature=0.7)["field"] == "temperature"
    error = refusal(client, "ct2", [{"text": sources[0], "constraints": ["Haus"]}])
    assert error["field"] == "segments" and error["message"].startswith("segment 0: constraints")
    error = refusal(client, "ct2", [{"text": sources[0], "avoid": ["Haus"]}])
    assert error["field"] == "segments" and "avoid" in error["message"]
    # a seed: CTranslate2 seeds its generators when the model loads, so a seeded sample is refused ...
    error = refusal(client, "ct2", sources, sampling=True, seed=3)
    assert error["field"] == "seed" and "backend torch" in error["message"]
    # ... the torch backend takes it, and a seed without sampling changes nothing (as on torch)
    assert translate(client, "torch", sources, sampling=True, seed=3)
    assert translate(client, "ct2", sources, seed=3) == translate(client, "ct2", sources)
    # the next good requests are answered as before
    texts = [t["translation"] for t in translate(client, "ct2", sources)]
    assert texts == [t["translation"] for t in translate(client, "torch", sources)]


def test_defaults_ctranslate2_refuses_are_caught_at_start_up(checkpoint: str, tmp_path: Path) -> None:
    entry = serve_settings(checkpoint, tmp_path).models[1]
    model = load_model(entry)

    def start(decoding: dict) -> str:
        with pytest.raises(ServeConfigError) as caught:
            check_model(dataclasses.replace(entry, key="models[1]", decoding=decoding), model)
        message = str(caught.value)
        assert "\n" not in message and message.startswith("models[1].decoding: backend ctranslate2")
        return message

    # beam 4 at the checkpoint's length penalty 0.6: either key fixes it
    message = start({"beam_size": 4})
    assert message.endswith("set models[1].decoding.beam_size: 1 or models[1].decoding.length_penalty: 0"), (
        message
    )
    # n_best 2 with beam 4 at length penalty 0: only n_best (beam 1 cannot give two hypotheses)
    message = start({"beam_size": 4, "n_best": 2, "length_penalty": 0})
    assert message.endswith("); use n_best=1 or backend torch; set models[1].decoding.n_best: 1"), message
    # both: no one key is enough, the pairs are named
    message = start({"beam_size": 4, "n_best": 2})
    assert message.endswith(
        "set models[1].decoding.beam_size: 1 and models[1].decoding.n_best: 1, "
        "or models[1].decoding.length_penalty: 0 and models[1].decoding.n_best: 1"
    ), message
    assert start({"temperature": 0.5}).endswith("set models[1].decoding.temperature: 1")
    # the fixes it names are taken
    for decoding in ({"beam_size": 4, "length_penalty": 0}, {"beam_size": 1}):
        served = check_model(dataclasses.replace(entry, decoding=decoding), model)
        assert served.defaults.beam_size == decoding["beam_size"]


def test_serve_py_refuses_such_defaults_in_one_line_before_listening(checkpoint: str, tmp_path: Path) -> None:
    port = free_port()
    models = (
        f"models=[{{id: m, checkpoint: '{checkpoint}', backend: ctranslate2, decoding: {{beam_size: 4}}}}]"
    )
    args = [models, f"port={port}", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_script("serve.py", args, env=cli_env(), timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "models[0].decoding.beam_size: 1 or models[0].decoding.length_penalty: 0" in errors[0]


def test_config_refusals_name_the_key(
    checkpoint: str, classification_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(entry: dict) -> str:
        with pytest.raises(ServeConfigError) as caught:
            ServeSettings.from_dict({"models": [{"id": "m", "checkpoint": checkpoint, **entry}]})
        assert "\n" not in str(caught.value)
        return str(caught.value)

    supported = sorted(ctranslate2.get_supported_compute_types("cpu"))
    for compute_type in ("default", "auto", *supported):
        entry = {"id": "m", "checkpoint": checkpoint, "backend": "ctranslate2", "compute_type": compute_type}
        assert ServeSettings.from_dict({"models": [entry]}).models[0].compute_type == compute_type
    message = refused({"backend": "ctranslate2", "compute_type": "int3"})
    assert message.startswith("models[0].compute_type=int3 is not") and str(supported) in message
    assert refused({"compute_type": "int8"}).startswith("models[0].compute_type=int8 is a setting of backend")
    assert refused({"cache_dir": "x"}).startswith("models[0].cache_dir=x is a setting of backend ctranslate2")
    message = refused({"backend": "ctranslate2", "checkpoint": [checkpoint, checkpoint]})
    assert message.startswith("models[0].checkpoint: backend ctranslate2 decodes one checkpoint, got 2")
    # a classifier: the backend is at fault
    classifier = str(classification_run / "checkpoints" / "last.ckpt")
    entry = ServeSettings.from_dict(
        {"models": [{"id": "c", "checkpoint": classifier, "backend": "ctranslate2"}]}
    ).models[0]
    with pytest.raises(ServeConfigError, match=r"^models\[0\]\.backend=ctranslate2: .* classification"):
        load_model(entry)
    # device auto on a machine whose torch sees CUDA and whose ctranslate2 does not
    with monkeypatch.context() as patched:
        patched.setattr("torch.cuda.is_available", lambda: True)
        patched.setattr(ctranslate2, "get_cuda_device_count", lambda: 0)
        message = refused({"backend": "ctranslate2", "device": "auto"})
        assert message.startswith("models[0].device=auto: this ctranslate2 sees no CUDA device")
    # ctranslate2 not installed: the extra to install
    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    message = refused({"backend": "ctranslate2"})
    assert message.startswith("models[0].backend=ctranslate2 needs the ctranslate2 package") and (
        "pip install 'aiayn[export]'" in message
    )


def test_serve_py_names_the_extra_when_ctranslate2_is_missing(checkpoint: str, tmp_path: Path) -> None:
    """serve.py itself: ctranslate2 hidden from the interpreter, one `error:` line naming the extra."""
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "ctranslate2.py").write_text("raise ImportError('hidden by the test')\n")
    env = {**cli_env(), "PYTHONPATH": os.pathsep.join([str(hidden), str(REPO_ROOT)])}
    models = f"models=[{{id: m, checkpoint: '{checkpoint}', backend: ctranslate2}}]"
    args = [models, f"port={free_port()}", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_script("serve.py", args, env=env, fresh=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "aiayn[export]" in errors[0], result.stderr[-2000:]
