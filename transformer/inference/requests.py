"""Target text a translation must start with, contain or avoid -> `TargetRequest`s in target token ids,
encoded as the output is tokenized, with one `InferenceError` naming the input and key for a phrase no
output could satisfy. `evaluate.py`'s JSONL input (`transformer.cli.translate_input`) encodes with the same
`PhraseEncoder`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformer.inference.outputs import InferenceError, Segment
from transformer.search.constraints import TargetRequest

__all__ = ["PhraseEncoder", "check_no_conflict"]


class PhraseEncoder:
    """Encodes target phrases with `encode` (the target tokenizer's; `specials`, its BOS and EOS, dropped).

    The project's BPE marks each word start with "▁" whether the word starts the text or not, so a phrase
    encoded alone has the pieces it has inside a sentence. A phrase with a character the tokenizer cannot
    encode (it would become `unk_id`) is refused: no output could ever contain it."""

    def __init__(self, encode: Callable[[str], list[int]], specials: tuple[int, int], unk_id: int | None):
        self.encode, self.specials, self.unk_id = encode, specials, unk_id

    @classmethod
    def of(cls, tokenizer: Any) -> PhraseEncoder:
        """The encoder of a target tokenizer (`encode`, `bos_id`, `eos_id`, optionally `unk_id`)."""
        return cls(tokenizer.encode, (tokenizer.bos_id, tokenizer.eos_id), getattr(tokenizer, "unk_id", None))

    def tokens(self, where: str, key: str, text: str) -> tuple[int, ...]:
        """The ids of the phrase `text` (whitespace runs as one space); `where` and `key` name it."""
        ids = [i for i in self.encode(" ".join(text.split())) if i not in self.specials]
        if not ids:
            raise InferenceError(f"{where}: {key} {text!r} encodes to no token")
        if self.unk_id is not None and self.unk_id in ids:
            raise InferenceError(
                f"{where}: {key} {text!r} has characters the target tokenizer cannot encode (they map to "
                "<unk>, which no output contains)"
            )
        return tuple(ids)

    def phrases(self, where: str, key: str, value: Any) -> tuple[tuple[int, ...], ...]:
        """A list of phrases (`key`: "constraints" or "avoid") as ids, each a non-empty string."""
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise InferenceError(f"{where}: {key} must be a list of strings, got {value!r}")
        phrases = []
        for i, phrase in enumerate(value):
            if not isinstance(phrase, str):
                raise InferenceError(f"{where}: {key}[{i}] must be a string, got {phrase!r}")
            if not phrase.strip():
                raise InferenceError(f"{where}: {key}[{i}] is empty; a phrase needs at least one word")
            phrases.append(self.tokens(where, f"{key}[{i}]", phrase))
        return tuple(phrases)

    def request(self, where: str, segment: Segment) -> TargetRequest:
        """A `Segment`'s prefix, constraints and avoided phrases as one checked request."""
        prefix = segment.prefix or ""
        if not isinstance(prefix, str):
            raise InferenceError(f"{where}: prefix must be a string, got {prefix!r}")
        request = TargetRequest(
            prefix=self.tokens(where, "prefix", prefix) if prefix.strip() else (),
            include=self.phrases(where, "constraints", segment.constraints),
            avoid=self.phrases(where, "avoid", segment.avoid),
        )
        check_no_conflict(where, request, list(segment.avoid))
        return request


def check_no_conflict(where: str, request: TargetRequest, avoid_texts: Sequence[str]) -> None:
    """InferenceError for an avoided phrase that the prefix or a required phrase contains: no output could
    both hold it and avoid it (the search would have to break one promise silently)."""
    wanted = [("prefix", request.prefix)] if request.prefix else []
    wanted += [(f"constraints[{j}]", phrase) for j, phrase in enumerate(request.include)]
    for i, avoided in enumerate(request.avoid):
        for key, tokens in wanted:
            if _contains(tokens, avoided):
                raise InferenceError(
                    f"{where}: avoid[{i}] {avoid_texts[i]!r} occurs in {key}: no translation can contain "
                    "and avoid it; drop one of the two"
                )


def _contains(tokens: tuple[int, ...], phrase: tuple[int, ...]) -> bool:
    n = len(phrase)
    return any(tokens[k : k + n] == phrase for k in range(len(tokens) - n + 1))
