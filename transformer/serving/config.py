"""The serve settings (`configs/serve.yaml`) as typed data, built from a plain dict: every value checked
here, once, with an error naming its key (`ServeConfigError`). Files and models are checked when they load
(`transformer.serving.models`); the port when it is bound (`serve.py`)."""

from __future__ import annotations

import importlib
import ipaddress
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "BACKENDS",
    "BatchingSettings",
    "ModelSettings",
    "ServeConfigError",
    "ServeSettings",
    "is_loopback",
]

# backend name -> what runs the model (`models.load_model` maps each to its loader)
BACKENDS = ("torch", "ctranslate2")
# the optional dependency a backend needs, and the extra of this package that installs it
_BACKEND_EXTRAS = {"ctranslate2": ("ctranslate2", "export")}


class ServeConfigError(ValueError):
    """A serve setting that cannot work: one line naming its key, the value and what was expected."""


@dataclass(frozen=True)
class BatchingSettings:
    """Dynamic batching and request limits (docs/serving.md, "Batching")."""

    max_batch_tokens: int = 4096  # source tokens (estimated: characters / 4 + 2 a segment) per model call
    max_wait_ms: float = 5.0  # how long the worker waits for more requests once it has one
    queue_size: int = 256  # requests waiting per model; beyond it: 429
    max_segments: int = 256  # segments per request; beyond it: 413
    max_chars: int = 100_000  # characters per request (segments, prefixes, phrases); beyond it: 413
    timeout_s: float = 30.0  # a request's deadline from its arrival; past it: 504


@dataclass(frozen=True)
class ModelSettings:
    """One served model: its id in requests, its checkpoint(s) (several: an ensemble), where and how it runs,
    and its decoding defaults over the checkpoint's own."""

    id: str
    checkpoint: tuple[str, ...]
    device: str = "cpu"
    backend: str = "torch"
    decoding: Mapping[str, Any] = field(default_factory=dict)
    # a multilingual model's target language for requests that name none (checked against its labels)
    target_lang: str | None = None
    key: str = "models[0]"  # where it stands in the config, for error messages
    # backend ctranslate2 only (None for torch): CTranslate2's compute type ("default": the converted float32
    # weights; int8, int8_float32, float16, ...: quantized when loaded) and where converted models are kept
    # (None: a temporary directory, converted at each start and removed at exit)
    compute_type: str | None = None
    cache_dir: str | None = None


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allow_remote_without_key: bool = False
    cors_origins: tuple[str, ...] = ()
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    models: tuple[ModelSettings, ...] = ()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ServeSettings:
        """The settings of `values` (serve.yaml's keys); ServeConfigError naming the first bad key."""
        known = {"host", "port", "api_key", "allow_remote_without_key", "cors_origins", "batching", "models"}
        _unknown_keys(values, known, "")
        host = _string(values, "host", "127.0.0.1")
        port = _integer(values, "port", 8000, least=0)
        if port > 65535:
            raise ServeConfigError(f"port must be an integer in [0, 65535], got {port}")
        api_key = values.get("api_key")
        if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
            raise ServeConfigError(f"api_key must be a non-empty string or null, got {api_key!r}")
        remote_ok = values.get("allow_remote_without_key", False)
        if not isinstance(remote_ok, bool):
            raise ServeConfigError(f"allow_remote_without_key must be true or false, got {remote_ok!r}")
        if api_key is None and not remote_ok and not is_loopback(host):
            raise ServeConfigError(
                f"host={host} listens beyond this machine without an api_key: set api_key (or the "
                "environment variable serve.yaml reads it from), or allow_remote_without_key=true "
                "to serve without one on purpose"
            )
        origins = values.get("cors_origins") or []
        if isinstance(origins, str) or not isinstance(origins, Sequence):
            raise ServeConfigError(f"cors_origins must be a list of origins, got {origins!r}")
        for i, origin in enumerate(origins):
            if not isinstance(origin, str) or not origin:
                raise ServeConfigError(f"cors_origins[{i}] must be an origin such as https://example.org")
        return cls(
            host=host,
            port=port,
            api_key=api_key,
            allow_remote_without_key=remote_ok,
            cors_origins=tuple(origins),
            batching=_batching(values.get("batching") or {}),
            models=_models(values.get("models")),
        )


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve beyond this machine
        return False


def _batching(values: Any) -> BatchingSettings:
    if not isinstance(values, Mapping):
        raise ServeConfigError(f"batching must be a mapping of limits, got {values!r}")
    defaults = BatchingSettings()
    _unknown_keys(values, set(defaults.__dataclass_fields__), "batching.")
    return BatchingSettings(
        max_batch_tokens=_integer(values, "max_batch_tokens", defaults.max_batch_tokens, 1, "batching."),
        max_wait_ms=_number(values, "max_wait_ms", defaults.max_wait_ms, 0.0, "batching."),
        queue_size=_integer(values, "queue_size", defaults.queue_size, 1, "batching."),
        max_segments=_integer(values, "max_segments", defaults.max_segments, 1, "batching."),
        max_chars=_integer(values, "max_chars", defaults.max_chars, 1, "batching."),
        timeout_s=_number(values, "timeout_s", defaults.timeout_s, 1e-3, "batching."),
    )


def _models(values: Any) -> tuple[ModelSettings, ...]:
    if values is None or (isinstance(values, Sequence) and not isinstance(values, str) and not values):
        raise ServeConfigError("models is empty: list at least one model ({id, checkpoint}) to serve")
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise ServeConfigError(f"models must be a list of {{id, checkpoint, ...}}, got {values!r}")
    models: list[ModelSettings] = []
    for i, entry in enumerate(values):
        key = f"models[{i}]"
        if not isinstance(entry, Mapping):
            raise ServeConfigError(f"{key} must be a mapping {{id, checkpoint, ...}}, got {entry!r}")
        _unknown_keys(
            entry,
            {"id", "checkpoint", "device", "backend", "decoding", "target_lang", "compute_type", "cache_dir"},
            f"{key}.",
        )
        model_id = entry.get("id")
        if not isinstance(model_id, str) or not model_id.strip() or model_id != model_id.strip():
            raise ServeConfigError(
                f"{key}.id must be a non-empty name without surrounding spaces, got {model_id!r}"
            )
        earlier = [m.key for m in models if m.id == model_id]
        if earlier:
            raise ServeConfigError(f"{key}.id={model_id} is also the id of {earlier[0]}: ids must be unique")
        checkpoint = _checkpoints(entry.get("checkpoint"), f"{key}.checkpoint")
        device = _device(entry.get("device", "cpu"), f"{key}.device")
        backend = _backend(entry.get("backend", "torch"), f"{key}.backend")
        compute_type, cache_dir = entry.get("compute_type"), entry.get("cache_dir")
        target_lang = entry.get("target_lang")
        if target_lang is not None and (not isinstance(target_lang, str) or not target_lang.strip()):
            raise ServeConfigError(
                f"{key}.target_lang must be a language code (one of the model's target languages) or null, "
                f"got {target_lang!r}"
            )
        if backend == "ctranslate2":
            if len(checkpoint) > 1:
                raise ServeConfigError(
                    f"{key}.checkpoint: backend ctranslate2 decodes one checkpoint, got {len(checkpoint)}: "
                    "an ensemble needs backend torch (or average the checkpoints into one file first)"
                )
            compute_type = _compute_type(compute_type, device, key)
            if cache_dir is not None and (not isinstance(cache_dir, str) or not cache_dir):
                raise ServeConfigError(
                    f"{key}.cache_dir must be a directory path or null (a temporary one), got {cache_dir!r}"
                )
        else:
            for name, value in (("compute_type", compute_type), ("cache_dir", cache_dir)):
                if value is not None:
                    raise ServeConfigError(
                        f"{key}.{name}={value} is a setting of backend ctranslate2, not of backend "
                        f"{backend}: set {key}.backend: ctranslate2 or leave {key}.{name} out"
                    )
        models.append(
            ModelSettings(
                id=model_id,
                checkpoint=checkpoint,
                device=device,
                backend=backend,
                decoding=_decoding(entry.get("decoding") or {}, f"{key}.decoding"),
                target_lang=target_lang,
                key=key,
                compute_type=compute_type,
                cache_dir=cache_dir,
            )
        )
    return tuple(models)


def _checkpoints(value: Any, key: str) -> tuple[str, ...]:
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, Sequence) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise ServeConfigError(
            f"{key} must be a checkpoint path or a list of them (an ensemble), got {value!r}"
        )
    return tuple(paths)


def _device(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ServeConfigError(f"{key} must be a device name such as cpu or cuda:0, got {value!r}")
    if value == "auto":  # CUDA when available, else the CPU (the inference API decides)
        return value
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ServeConfigError(
            f"{key}={value} is not a device (expected cpu, cuda, cuda:N, mps or auto)"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ServeConfigError(f"{key}={value}: CUDA is not available on this machine (use cpu)")
        if device.index is not None and device.index >= count:
            raise ServeConfigError(f"{key}={value}: this machine has {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ServeConfigError(f"{key}={value}: MPS is not available on this machine (use cpu)")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ServeConfigError(f"{key}={value}: expected cpu, cuda, cuda:N or mps")
    return value


def _backend(value: Any, key: str) -> str:
    if value not in BACKENDS:
        raise ServeConfigError(f"{key}={value} is not a backend; expected one of {list(BACKENDS)}")
    if value in _BACKEND_EXTRAS:
        module, extra = _BACKEND_EXTRAS[value]
        try:
            importlib.import_module(module)
        except ImportError:
            raise ServeConfigError(
                f"{key}={value} needs the {module} package, which is not installed: "
                f"pip install 'aiayn[{extra}]' (or backend torch)"
            ) from None
    return value


def _compute_type(value: Any, device: str, key: str) -> str:
    """CTranslate2's compute type of a model on `device`, checked against what CTranslate2 supports there."""
    import ctranslate2  # installed: _backend checked it

    where = "cuda" if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()) else "cpu"
    if device.startswith("mps"):
        raise ServeConfigError(f"{key}.device={device}: backend ctranslate2 runs on cpu or cuda")
    if where == "cuda" and ctranslate2.get_cuda_device_count() == 0:
        raise ServeConfigError(
            f"{key}.device={device}: this ctranslate2 sees no CUDA device (a CPU-only build, or a driver "
            "it cannot use): set device: cpu or install a CUDA build of ctranslate2"
        )
    supported = sorted(ctranslate2.get_supported_compute_types(where))
    if value is None:
        return "default"
    if value not in ("default", "auto", *supported):
        raise ServeConfigError(
            f"{key}.compute_type={value} is not a compute type CTranslate2 supports on {where}; expected "
            f"default (the float32 weights), auto or one of {supported}"
        )
    return value


def _decoding(value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ServeConfigError(f"{key} must be a mapping of decoding options, got {value!r}")
    return dict(value)  # checked by the model's own settings() once it is loaded


def _unknown_keys(values: Mapping[str, Any], known: set[str], prefix: str) -> None:
    unknown = sorted(set(values) - known)
    if unknown:
        raise ServeConfigError(f"unknown key {prefix}{unknown[0]}; expected some of {sorted(known)}")


def _string(values: Mapping[str, Any], key: str, default: str) -> str:
    value = values.get(key, default)
    if not isinstance(value, str) or not value:
        raise ServeConfigError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _integer(values: Mapping[str, Any], key: str, default: int, least: int, prefix: str = "") -> int:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ServeConfigError(f"{prefix}{key} must be an integer >= {least}, got {value!r}")
    return value


def _number(values: Mapping[str, Any], key: str, default: float, least: float, prefix: str = "") -> float:
    value = values.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < least
    ):
        raise ServeConfigError(f"{prefix}{key} must be a number >= {least}, got {value!r}")
    return float(value)
