"""The served models: each config entry loaded through the inference API by its backend, its decoding
defaults checked, and what `/v1/models` says about it."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformer.inference import InferenceError, load
from transformer.search.decoding import DecodingSettings
from transformer.serving.config import BACKENDS, ModelSettings, ServeConfigError

__all__ = ["LOADERS", "Served", "check_model", "load_model"]


def _load_torch(settings: ModelSettings) -> Any:
    return load([Path(p) for p in settings.checkpoint], device=settings.device)


# backend -> loader (config.BACKENDS names the same ones)
LOADERS: dict[str, Callable[[ModelSettings], Any]] = {"torch": _load_torch}
assert set(LOADERS) == set(BACKENDS), "every backend of the config has a loader"


def load_model(settings: ModelSettings) -> Any:
    """The `Translator` or `Classifier` of `settings`; ServeConfigError naming its key for a missing or
    foreign checkpoint (the inference API's message names the file)."""
    for i, path in enumerate(settings.checkpoint):
        key = f"{settings.key}.checkpoint" + (f"[{i}]" if len(settings.checkpoint) > 1 else "")
        if not Path(path).is_file():
            raise ServeConfigError(f"{key}={path}: no such checkpoint file")
    try:
        return LOADERS[settings.backend](settings)
    except InferenceError as err:
        raise ServeConfigError(f"{settings.key}.checkpoint: {err}") from None


@dataclass(frozen=True)
class Served:
    """A loaded model with its config entry and (translation) its decoding defaults."""

    settings: ModelSettings
    model: Any
    defaults: DecodingSettings | None

    @property
    def task(self) -> str:
        return self.model.task

    def decoding(self, options: Mapping[str, Any]) -> DecodingSettings:
        """The model's defaults with a request's `options` over them (InferenceError naming a bad one)."""
        return self.model.settings(**{**self.settings.decoding, **options})

    def description(self) -> dict[str, Any]:
        """The model's entry of `GET /v1/models`."""
        source, target = getattr(self.model, "languages", (None, None))
        entry: dict[str, Any] = {
            "id": self.settings.id,
            "task": self.task,
            "backend": self.settings.backend,
            "languages": {"source": source, "target": target},
            "device": str(self.model.device),
            "parameters": int(self.model.num_parameters),
            "checkpoints": [Path(p).name for p in self.settings.checkpoint],
        }
        if self.defaults is not None:
            entry["decoding"] = {k: _plain(v) for k, v in self.defaults.items()}
        else:
            entry["labels"] = list(self.model.labels)
        return entry


def check_model(settings: ModelSettings, model: Any) -> Served:
    """`model` with its decoding defaults checked (ServeConfigError naming `<key>.decoding`)."""
    if model.task != "translation":
        if settings.decoding:
            raise ServeConfigError(
                f"{settings.key}.decoding: {settings.id} is a {model.task} model (no decoding)"
            )
        return Served(settings, model, None)
    try:
        defaults = model.settings(**settings.decoding)
    except InferenceError as err:
        raise ServeConfigError(f"{settings.key}.decoding: {err}") from None
    return Served(settings, model, defaults)


def _plain(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value
