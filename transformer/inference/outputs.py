"""What the inference API takes and gives: one input sentence with its target requests (`Segment`), a
translation's hypotheses, a classifier's prediction, and the one error type for a bad checkpoint, option
or input (`InferenceError`, a ValueError whose message names the file, option or value at fault)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Hypothesis", "InferenceError", "Prediction", "Segment", "Translation"]


class InferenceError(ValueError):
    """A checkpoint, option or input the inference API cannot use; the message names it and what was
    expected."""


@dataclass(frozen=True)
class Segment:
    """One input sentence and what its translation must start with (`prefix`), contain (`constraints`,
    by Dynamic Beam Allocation) and leave out (`avoid`), as target text; `target_lang`: the language to
    translate it into (a multilingual model's; None: the call's or the translator's default)."""

    text: str
    prefix: str | None = None
    constraints: tuple[str, ...] = ()
    avoid: tuple[str, ...] = ()
    target_lang: str | None = None


@dataclass(frozen=True)
class Hypothesis:
    """One output text and the search's score (summed log-probabilities over the length normalization)."""

    text: str
    score: float


@dataclass(frozen=True)
class Translation:
    """One input's hypotheses, best first (n_best of them, fewer when the search ended fewer), and whether
    its prefix and constraints could not fit in its length limit (its output then misses some)."""

    hypotheses: list[Hypothesis]
    unsatisfiable: bool = False

    @property
    def text(self) -> str:
        return self.hypotheses[0].text

    @property
    def score(self) -> float:
        return self.hypotheses[0].score


@dataclass(frozen=True)
class Prediction:
    """A classifier's answer for one text: the most probable class name and every class' probability."""

    label: str
    probabilities: dict[str, float]
