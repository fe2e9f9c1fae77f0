"""Target-language labels of multilingual translation: OPUS-MT's `>>fra<<`, fairseq's language tokens.

A many-to-many or one-to-many model learns which language to produce from a label put at the start of
the source (`>>de<< A dog runs.`; `data.labels.position=end` puts it after the source instead). Each
label is one atomic token of the source tokenizer (a special token of our BPE, a piece of an imported
SentencePiece vocabulary), never split. The model does not change: the label is text the tokenizer
knows, plus one decoding option (`target_lang`) that chooses it.
A checkpoint lists its labels under the top-level key `LABELS_KEY`; a bilingual checkpoint has none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

LABELS_KEY = "language_labels"  # the checkpoint's top-level key: `LanguageLabels.to_state()`
DEFAULT_FORMAT = ">>{lang}<<"  # OPUS-MT's spelling; `data.labels.format` chooses another
Position = Literal["start", "end"]  # where the label goes in the source (`data.labels.position`)
POSITIONS: tuple[str, ...] = get_args(Position)


class LabelError(ValueError):
    """A target language the model has no label for, or a label asked of a bilingual model."""


@dataclass(frozen=True)
class LanguageLabels:
    """The label token of each target language, e.g. `{"de": ">>de<<", "fr": ">>fr<<"}`, and where it goes:
    before the source ("start": OPUS-MT, fairseq's `--encoder-langtok tgt`, Google's multilingual NMT) or
    after it ("end", where mBART puts its language code)."""

    labels: Mapping[str, str]
    position: Position = "start"

    def __post_init__(self) -> None:
        check_position(self.position)
        if not self.labels:
            raise ValueError("a multilingual model needs at least one target-language label")
        for lang, label in self.labels.items():
            if not lang or not label or any(c.isspace() for c in label):
                raise ValueError(f"the label of target language {lang!r} must be one word, got {label!r}")

    @classmethod
    def for_languages(
        cls, langs: Iterable[str], format: str = DEFAULT_FORMAT, position: Position = "start"
    ) -> LanguageLabels:
        """Labels spelled by `format` (`check_format`), in sorted language order."""
        check_format(format)
        return cls({lang: format.format(lang=lang) for lang in sorted(set(langs))}, position)

    @property
    def languages(self) -> list[str]:
        return sorted(self.labels)

    @property
    def tokens(self) -> list[str]:
        """The label tokens, in language order: the special tokens a tokenizer must keep whole."""
        return [self.labels[lang] for lang in self.languages]

    def label(self, lang: str | None, where: str = "target_lang") -> str:
        """The label of `lang`; a missing or unknown language raises `LabelError` naming `where` and the
        valid languages."""
        if lang is None:
            raise LabelError(
                f"{where}: this model is multilingual; choose a target language: {self._valid()}"
            )
        if lang not in self.labels:
            raise LabelError(f"{where}: unknown target language {lang!r}; this model knows {self._valid()}")
        return self.labels[lang]

    def labelled(self, text: str, lang: str | None, where: str = "target_lang") -> str:
        """`text` with the label of `lang` where the model saw it in its training sources."""
        label = self.label(lang, where)
        return f"{label} {text}" if self.position == "start" else f"{text} {label}"

    def to_state(self) -> dict[str, Any]:
        return {"labels": dict(self.labels), "position": self.position}

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> LanguageLabels | None:
        """The labels a checkpoint lists under `LABELS_KEY`, or None for a bilingual model (a state without
        a position, written before there was a choice, put its labels at the start)."""
        if not state:
            return None
        return cls(dict(state["labels"]), state.get("position", "start"))

    def _valid(self) -> str:
        return ", ".join(self.languages)


def check_position(position: object) -> None:
    """ValueError unless `position` is one of POSITIONS (where a label goes in the source)."""
    if position not in POSITIONS:
        raise ValueError(f"a label's position must be one of {', '.join(POSITIONS)}, got {position!r}")


def check_format(format: str) -> None:
    """ValueError unless `format` spells one word holding `{lang}` and no other field (`>>{lang}<<`)."""
    if not isinstance(format, str) or "{lang}" not in format:
        raise ValueError(f"a label format must contain {{lang}}, got {format!r}")
    if any(c.isspace() for c in format):
        raise ValueError(f"a label format must spell one word (no spaces), got {format!r}")
    try:
        format.format(lang="de")
    except (IndexError, KeyError, ValueError):
        raise ValueError(f"a label format may hold {{lang}} and no other {{field}}, got {format!r}") from None


def labelled_sources(
    texts: Iterable[str],
    langs: Iterable[str | None],
    labels: LanguageLabels | None,
    where: str = "target_lang",
    bilingual_target: str | None = None,
) -> list[str]:
    """Sources ready for the tokenizer: labelled for a multilingual model. A bilingual model (`labels`
    None) gets them unchanged and ignores a `target_lang` equal to its own target (`bilingual_target`, when
    known); any other language raises `LabelError`, since its output could not follow it."""
    texts, langs = list(texts), list(langs)
    if labels is None:
        other = next((lang for lang in langs if lang is not None and lang != bilingual_target), None)
        if other is not None and bilingual_target is not None:
            raise LabelError(
                f"{where}: {other!r} given, but this model translates into {bilingual_target!r} only (it has "
                "no target-language labels)"
            )
        return texts
    return [labels.labelled(text, lang, where) for text, lang in zip(texts, langs, strict=True)]
