"""What `evaluate.py translate.input=FILE|-` reads: lines of UTF-8 text (a line that is not names its file
and line), and with `translate.format=jsonl` one JSON object a line, the source and what its translation
must start with, contain or avoid, checked and encoded as the target tokenizer encodes the output."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from transformer.cli.errors import ConfigError
from transformer.search.constraints import TargetRequest

__all__ = ["FORMATS", "KEYS", "Entry", "EntryParser", "text_lines"]

FORMATS = ("text", "jsonl")
KEYS = ("src", "prefix", "constraints", "avoid")  # src required, the others optional


def text_lines(stream: Iterable[bytes], name: str) -> Iterator[str]:
    """The lines of a byte stream as text; a line that is not UTF-8 is one error naming `name` and it."""
    for number, raw in enumerate(stream, start=1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{name} line {number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1}"
                " of the line); translate.input takes UTF-8 text, one sentence a line"
            ) from None


@dataclass(frozen=True)
class Entry:
    """One JSONL input line: its number (1-based), its source text and its target request."""

    line: int
    src: str
    request: TargetRequest


class EntryParser:
    """Parses one JSONL line into an `Entry` (`name`: the input file, or stdin, for the error lines).

    Phrases are encoded with `encode` (the target tokenizer's, BOS and EOS dropped), as the output is
    tokenized: the project's BPE marks each word start with "▁" whether the word starts the text or not,
    so a phrase encoded alone has the pieces it has inside a sentence. A phrase with a character the
    tokenizer cannot encode (it would become `unk_id`) is refused: no output could ever contain it."""

    def __init__(
        self, name: str, encode: Callable[[str], list[int]], specials: tuple[int, int], unk_id: int | None
    ):
        self.name, self.encode, self.specials, self.unk_id = name, encode, specials, unk_id

    def __call__(self, number: int, text: str) -> Entry:
        where = f"{self.name} line {number}"
        try:
            item = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not JSON ({err.msg} at column {err.colno}); {_EXPECTED}") from None
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: a JSON {type(item).__name__}, not an object; {_EXPECTED}")
        unknown = [key for key in item if key not in KEYS]
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}; {_EXPECTED}")
        src = item.get("src")
        if not isinstance(src, str) or not src.strip():
            raise ConfigError(f"{where}: src must be a non-empty string, got {src!r}")
        prefix = item.get("prefix", "")
        if not isinstance(prefix, str):
            raise ConfigError(f"{where}: prefix must be a string, got {prefix!r}")
        request = TargetRequest(
            prefix=self._tokens(where, "prefix", prefix) if prefix.strip() else (),
            include=self._phrases(where, "constraints", item.get("constraints", [])),
            avoid=self._phrases(where, "avoid", item.get("avoid", [])),
        )
        _check_no_conflict(where, request, item)
        return Entry(number, " ".join(src.split()), request)

    def _phrases(self, where: str, key: str, value: Any) -> tuple[tuple[int, ...], ...]:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {key} must be a list of strings, got {value!r}")
        phrases = []
        for i, phrase in enumerate(value):
            if not isinstance(phrase, str):
                raise ConfigError(f"{where}: {key}[{i}] must be a string, got {phrase!r}")
            if not phrase.strip():
                raise ConfigError(f"{where}: {key}[{i}] is empty; a phrase needs at least one word")
            phrases.append(self._tokens(where, f"{key}[{i}]", phrase))
        return tuple(phrases)

    def _tokens(self, where: str, key: str, text: str) -> tuple[int, ...]:
        ids = [i for i in self.encode(" ".join(text.split())) if i not in self.specials]
        if not ids:
            raise ConfigError(f"{where}: {key} {text!r} encodes to no token")
        if self.unk_id is not None and self.unk_id in ids:
            raise ConfigError(
                f"{where}: {key} {text!r} has characters the target tokenizer cannot encode (they map to "
                "<unk>, which no output contains)"
            )
        return tuple(ids)


def _check_no_conflict(where: str, request: TargetRequest, item: dict[str, Any]) -> None:
    """ConfigError for an avoided phrase that the prefix or a required phrase contains: no output could
    both hold it and avoid it (the search would have to break one promise silently)."""
    wanted = [("prefix", request.prefix)] if request.prefix else []
    wanted += [(f"constraints[{j}]", phrase) for j, phrase in enumerate(request.include)]
    for i, avoided in enumerate(request.avoid):
        for key, tokens in wanted:
            if _contains(tokens, avoided):
                raise ConfigError(
                    f"{where}: avoid[{i}] {item['avoid'][i]!r} occurs in {key}: no translation can contain "
                    "and avoid it; drop one of the two"
                )


def _contains(tokens: tuple[int, ...], phrase: tuple[int, ...]) -> bool:
    n = len(phrase)
    return any(tokens[k : k + n] == phrase for k in range(len(tokens) - n + 1))


_EXPECTED = (
    f"translate.format=jsonl takes one JSON object a line with the keys {', '.join(KEYS)} (src required)"
)
