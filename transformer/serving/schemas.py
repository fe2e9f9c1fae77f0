"""The request bodies of `/v1/translate` and `/v1/classify` (pydantic, strict: a wrong type is refused,
never converted; an unknown field is refused), and the JSON of their answers."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from transformer.inference import Prediction, Segment, Translation

__all__ = ["ClassifyRequest", "SegmentIn", "TranslateRequest", "prediction_json", "translation_json"]

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, protected_namespaces=())

# the decoding options a request may set (DecodingSettings' names; checked by the model's settings())
DECODING_OPTIONS = (
    "beam_size",
    "n_best",
    "length_penalty",
    "sampling",
    "top_k",
    "top_p",
    "temperature",
    "max_len_a",
    "max_len_b",
    "min_len",
)


# the largest beam_size / n_best a request may ask for (docs/serving.md)
MAX_BEAM = 64


class SegmentIn(BaseModel):
    """A segment with target requests: a prefix the translation starts with, phrases it must contain or
    avoid, the language to translate it into (a multilingual model's; None: the request's)."""

    model_config = _STRICT
    text: str
    prefix: str | None = None
    constraints: list[str] = Field(default_factory=list)
    avoid: list[str] = Field(default_factory=list)
    target_lang: str | None = None

    def segment(self, target_lang: str | None = None) -> Segment:
        own = self.target_lang if self.target_lang is not None else target_lang
        return Segment(self.text, self.prefix, tuple(self.constraints), tuple(self.avoid), own)

    def characters(self) -> int:
        return len(self.text) + len(self.prefix or "") + sum(map(len, (*self.constraints, *self.avoid)))


class TranslateRequest(BaseModel):
    model_config = _STRICT
    model: str
    segments: list[str | SegmentIn] = Field(min_length=1)
    # bounded here: the model takes any beam, and a client's beam of 100,000 asks for tens of GB
    beam_size: int | None = Field(default=None, le=MAX_BEAM)
    n_best: int | None = Field(default=None, le=MAX_BEAM)
    length_penalty: float | None = None
    sampling: bool | None = None
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    max_len_a: float | None = None
    max_len_b: int | None = None
    min_len: int | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    target_lang: str | None = None  # a multilingual model's target language, for segments naming none

    def options(self) -> dict[str, Any]:
        """The decoding options the request sets, as `DecodingSettings` names them (`sampling`: `search`
        "sample", or false: "auto"); the rest are the model's defaults."""
        options = {name: getattr(self, name) for name in DECODING_OPTIONS if getattr(self, name) is not None}
        if "sampling" in options:
            options["search"] = "sample" if options.pop("sampling") else "auto"
        return options

    def inputs(self, default_lang: str | None = None) -> list[str | Segment]:
        """The segments to translate, each carrying its target language (its own, else the request's, else
        the model's `default_lang`): requests for different languages may then share a model call."""
        lang = self.target_lang if self.target_lang is not None else default_lang
        return [
            (item if lang is None else Segment(item, target_lang=lang))
            if isinstance(item, str)
            else item.segment(lang)
            for item in self.segments
        ]

    def target_langs(self, default_lang: str | None = None) -> list[tuple[str | None, str]]:
        """Each segment's target language, as `inputs` resolves it, and the request field it came from (the
        model's `default_lang` stands for the request's `target_lang`)."""
        lang = self.target_lang if self.target_lang is not None else default_lang
        return [
            (item.target_lang, f"segments[{i}].target_lang")
            if isinstance(item, SegmentIn) and item.target_lang is not None
            else (lang, "target_lang")
            for i, item in enumerate(self.segments)
        ]

    def characters(self) -> int:
        return sum(len(item) if isinstance(item, str) else item.characters() for item in self.segments)


class ClassifyRequest(BaseModel):
    model_config = _STRICT
    model: str
    segments: list[str] = Field(min_length=1)

    def characters(self) -> int:
        return sum(map(len, self.segments))


def _score(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None  # JSON has no infinities


def translation_json(translation: Translation) -> dict[str, Any]:
    n_best = [{"translation": h.text, "score": _score(h.score)} for h in translation.hypotheses]
    best = n_best[0] if n_best else {"translation": "", "score": None}
    return {**best, "unsatisfiable": bool(translation.unsatisfiable), "n_best": n_best}


def prediction_json(prediction: Prediction) -> dict[str, Any]:
    return {"label": prediction.label, "probabilities": dict(prediction.probabilities)}
