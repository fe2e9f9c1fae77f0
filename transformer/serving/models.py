"""The served models: each config entry loaded through the inference API by its backend, its decoding
defaults checked, and what `/v1/models` says about it."""

from __future__ import annotations

import itertools
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


def _load_ctranslate2(settings: ModelSettings) -> Any:
    return load(
        [Path(p) for p in settings.checkpoint],
        device=settings.device,
        backend="ctranslate2",
        compute_type=settings.compute_type or "default",
        cache_dir=settings.cache_dir,
    )


# backend -> loader (config.BACKENDS names the same ones)
LOADERS: dict[str, Callable[[ModelSettings], Any]] = {"torch": _load_torch, "ctranslate2": _load_ctranslate2}
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
        # the key the message names: the backend (a classifier on ctranslate2), the compute type, or the file
        named = next((k for k in ("backend", "compute_type") if str(err).startswith(f"{k}=")), "checkpoint")
        where = f"{settings.key}.{err}" if named != "checkpoint" else f"{settings.key}.checkpoint: {err}"
        raise ServeConfigError(where) from None


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

    def check_seed(self, settings: DecodingSettings, seed: int | None) -> None:
        """InferenceError naming `seed` for a seeded sampling request on backend ctranslate2 (its random
        generators are seeded once, when the model loads: a request's seed could not fix its draws)."""
        if seed is not None and settings.sampling and self.settings.backend == "ctranslate2":
            raise InferenceError(
                f"seed={seed}: backend ctranslate2 samples with CTranslate2's own random generators, seeded "
                f"once when the model loads, so a request's seed cannot repeat its draws; leave seed out, or "
                f"send seeded sampling to a model with backend torch"
            )

    @property
    def target_lang(self) -> str | None:
        """The target language of requests and segments naming none (`models[i].target_lang`)."""
        return self.settings.target_lang

    def check_target_lang(self, lang: str | None, field: str) -> None:
        """InferenceError naming `field` for a target language the model cannot translate into, or none
        given to a multilingual model; the message lists the valid ones."""
        targets = self.model.target_languages
        if lang is not None:
            targets.check(lang, field)
        elif targets.multilingual:
            targets.sources([""], [None], field)  # raises: a multilingual model needs a language

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
            "compute_type": self.settings.compute_type,  # CTranslate2's (backend ctranslate2), else null
        }
        if self.defaults is not None:
            entry["decoding"] = {k: _plain(v) for k, v in self.defaults.items()}
            targets = self.model.target_languages
            # what a request's target_lang may name; multilingual: one of them must be named
            entry["target_languages"] = list(targets.languages)
            entry["multilingual"] = targets.multilingual
            entry["target_lang"] = self.target_lang  # where a request names none (null: it must)
        else:
            entry["labels"] = list(self.model.labels)
        return entry


def check_model(settings: ModelSettings, model: Any) -> Served:
    """`model` with its decoding defaults and target language checked (ServeConfigError naming
    `<key>.decoding` or `<key>.target_lang`)."""
    if model.task != "translation":
        for name, value in (("decoding", settings.decoding), ("target_lang", settings.target_lang)):
            if value:
                raise ServeConfigError(
                    f"{settings.key}.{name}: {settings.id} is a {model.task} model (no {name})"
                )
        return Served(settings, model, None)
    try:  # a language the model has no label for, or another than a bilingual model's target
        model.target_languages.check(settings.target_lang, f"{settings.key}.target_lang")
    except InferenceError as err:
        raise ServeConfigError(str(err)) from None
    try:
        defaults = model.settings(**settings.decoding)
    except InferenceError as err:
        fixes = _fixes(model, settings.decoding) if settings.backend != "torch" else []
        if not fixes:
            raise ServeConfigError(f"{settings.key}.decoding: {err}") from None
        shown = (" or " if len(fixes[0]) == 1 else ", or ").join(
            " and ".join(f"{settings.key}.decoding.{k}: {v}" for k, v in fix.items()) for fix in fixes
        )
        raise ServeConfigError(
            f"{settings.key}.decoding: backend {settings.backend} cannot decode with its defaults (the "
            f"checkpoint's, {settings.key}.decoding over them): {' '.join(str(err).split())}; set {shown}"
        ) from None
    return Served(settings, model, defaults)


# what a backend that refuses some decoding settings (ctranslate2) may be told to set instead, in order
_FIXES = (
    ("beam_size", 1),
    ("length_penalty", 0),
    ("n_best", 1),
    ("temperature", 1),
    ("min_len", 0),
    ("no_repeat_ngram_size", 0),
)


def _fixes(model: Any, decoding: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The smallest sets of decoding keys (one, else two) that make `model` take `decoding`'s defaults."""
    for size in (1, 2):
        found = []
        for fix in itertools.combinations(_FIXES, size):
            try:
                model.settings(**{**decoding, **dict(fix)})
            except InferenceError:
                continue
            found.append(dict(fix))
        if found:
            return found
    return []


def _plain(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value
