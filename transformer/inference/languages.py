"""The target language of a translation (issue 65): a multilingual checkpoint's labels (`data.labels`) put in
front of each source by `data.labels.labelled_sources`, the one place every backend of the inference API
(torch, CTranslate2) and every program on it (evaluate.py's translate.input, the server) labels a source.

A bilingual model has no labels: it takes sources as they are and a `target_lang` equal to its own target
(or none); any other language is refused, since its output could not follow it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.labels import LabelError, LanguageLabels, labelled_sources
from transformer.inference.outputs import InferenceError

__all__ = ["TargetLanguages"]


@dataclass(frozen=True)
class TargetLanguages:
    """What a model can translate into: its labels (None: bilingual) and a bilingual model's target code
    (None when the checkpoint does not name it)."""

    labels: LanguageLabels | None = None
    target: str | None = None

    @classmethod
    def of(
        cls, state: Mapping[str, Any] | None, target: str | None, path: Path | str = "<checkpoint>"
    ) -> TargetLanguages:
        """A checkpoint's `language_labels` state (`restore.saved_language_labels`) and its target code."""
        try:
            labels = LanguageLabels.from_state(state)
        except (KeyError, TypeError, ValueError) as err:
            raise InferenceError(f"checkpoint {path}: its language_labels cannot be read ({err})") from None
        return cls(labels, None if labels is not None else target)

    @property
    def multilingual(self) -> bool:
        return self.labels is not None

    @property
    def languages(self) -> list[str]:
        """The target languages a request may name: the labelled ones, or a bilingual model's target."""
        if self.labels is not None:
            return self.labels.languages
        return [self.target] if self.target is not None else []

    def check(self, lang: str | None, where: str = "target_lang") -> None:
        """InferenceError naming `where` for a language the model cannot translate into (None is checked
        when the sources are labelled: a multilingual model then needs one from somewhere)."""
        if lang is not None:
            self.sources(["x"], [lang], where)

    def sources(
        self, texts: Sequence[str], langs: Sequence[str | None], where: str | Sequence[str] = "target_lang"
    ) -> list[str]:
        """`texts` as the tokenizer takes them: each labelled with its language of `langs` (a multilingual
        model), or unchanged (a bilingual one). `where`: the name of the setting each language came from
        (one for all, or one per text), in the one error line of a language the model does not know."""
        if isinstance(where, str):
            return self._labelled(list(texts), list(langs), where)
        out: list[str] = []
        for text, lang, place in zip(texts, langs, where, strict=True):
            out.extend(self._labelled([text], [lang], place))
        return out

    def _labelled(self, texts: list[str], langs: list[str | None], where: str) -> list[str]:
        try:
            return labelled_sources(texts, langs, self.labels, where, bilingual_target=self.target)
        except LabelError as err:
            raise InferenceError(str(err)) from None
