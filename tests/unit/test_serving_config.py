"""configs/serve.yaml's values as `ServeSettings`: the defaults, and every bad value refused with one line
naming its key (serve.py turns it into its `error:` line before anything listens)."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers.repo import REPO_ROOT
from transformer.serving.config import ServeConfigError, ServeSettings, is_loopback

ONE_MODEL = {"models": [{"id": "en-de", "checkpoint": "a.ckpt"}]}


def test_the_defaults_and_an_ensemble() -> None:
    settings = ServeSettings.from_dict(
        {"models": [{"id": "a", "checkpoint": "a.ckpt"}, {"id": "b", "checkpoint": ["b1.ckpt", "b2.ckpt"]}]}
    )
    assert (settings.host, settings.port, settings.api_key, settings.cors_origins) == (
        "127.0.0.1",
        8000,
        None,
        (),
    )
    assert settings.batching.max_wait_ms == 5.0 and settings.batching.queue_size >= 1
    assert [m.checkpoint for m in settings.models] == [("a.ckpt",), ("b1.ckpt", "b2.ckpt")]
    assert [(m.device, m.backend, m.key) for m in settings.models] == [
        ("cpu", "torch", "models[0]"),
        ("cpu", "torch", "models[1]"),
    ]


def test_serve_yaml_has_every_key_the_settings_read() -> None:
    """The shipped config's keys are the settings' (no key documented there that the server ignores)."""
    values = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())
    values = {k: v for k, v in values.items() if k not in ("defaults", "task_name", "hydra")}
    values["api_key"] = None  # ${oc.env:...}: Hydra resolves it
    settings = ServeSettings.from_dict({**values, **ONE_MODEL})
    assert settings.batching.max_wait_ms == values["batching"]["max_wait_ms"]
    assert settings.batching.timeout_s == values["batching"]["timeout_s"]


BAD = {
    "no models": ({"models": []}, "models is empty"),
    "models missing": ({}, "models is empty"),
    "models not a list": ({"models": "a.ckpt"}, "models must be a list"),
    "duplicate ids": (
        {"models": [{"id": "x", "checkpoint": "a"}, {"id": "x", "checkpoint": "b"}]},
        "models[1].id=x is also the id of models[0]",
    ),
    "no checkpoint": ({"models": [{"id": "x"}]}, "models[0].checkpoint must be a checkpoint path"),
    "empty ensemble": ({"models": [{"id": "x", "checkpoint": []}]}, "models[0].checkpoint must be"),
    "unknown backend": (
        {"models": [{"id": "x", "checkpoint": "a", "backend": "onnx"}]},
        "models[0].backend=onnx is not a backend",
    ),
    "unknown device": (
        {"models": [{"id": "x", "checkpoint": "a", "device": "tpu"}]},
        "models[0].device=tpu",
    ),
    "device not a string": ({"models": [{"id": "x", "checkpoint": "a", "device": 0}]}, "models[0].device"),
    "unknown model key": (
        {"models": [{"id": "x", "checkpoint": "a", "beam_size": 4}]},
        "unknown key models[0].beam_size",
    ),
    "decoding not a mapping": (
        {"models": [{"id": "x", "checkpoint": "a", "decoding": 4}]},
        "models[0].decoding must be a mapping",
    ),
    "unknown key": ({**ONE_MODEL, "prot": 1}, "unknown key prot"),
    "port too large": ({**ONE_MODEL, "port": 70000}, "port must be an integer in [0, 65535]"),
    "port a string": ({**ONE_MODEL, "port": "80"}, "port must be an integer"),
    "remote without a key": ({**ONE_MODEL, "host": "0.0.0.0"}, "host=0.0.0.0 listens beyond this machine"),
    "empty key": ({**ONE_MODEL, "api_key": " "}, "api_key must be a non-empty string"),
    "opt-out not a bool": ({**ONE_MODEL, "allow_remote_without_key": "yes"}, "allow_remote_without_key"),
    "origins a string": ({**ONE_MODEL, "cors_origins": "*"}, "cors_origins must be a list"),
    "bad batching limit": ({**ONE_MODEL, "batching": {"queue_size": 0}}, "batching.queue_size must be"),
    "batching wait negative": ({**ONE_MODEL, "batching": {"max_wait_ms": -1}}, "batching.max_wait_ms"),
    "batching timeout infinite": (
        {**ONE_MODEL, "batching": {"timeout_s": float("inf")}},
        "batching.timeout_s",
    ),
    "unknown batching key": ({**ONE_MODEL, "batching": {"max_tokens": 9}}, "unknown key batching.max_tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_value_is_refused_naming_its_key(case: str) -> None:
    values, expected = BAD[case]
    with pytest.raises(ServeConfigError) as raised:
        ServeSettings.from_dict(values)
    assert expected in str(raised.value) and "\n" not in str(raised.value)


def test_device_auto_is_left_to_the_inference_api() -> None:
    settings = ServeSettings.from_dict({"models": [{"id": "x", "checkpoint": "a", "device": "auto"}]})
    assert settings.models[0].device == "auto"


def test_beyond_loopback_with_a_key_or_the_explicit_opt_out() -> None:
    assert ServeSettings.from_dict({**ONE_MODEL, "host": "0.0.0.0", "api_key": "k"}).api_key == "k"
    opted = ServeSettings.from_dict({**ONE_MODEL, "host": "::", "allow_remote_without_key": True})
    assert opted.api_key is None
    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "::1", "localhost")] == [True] * 4
    assert [is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.org")] == [False] * 4
