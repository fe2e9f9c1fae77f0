"""What `evaluate.py translate.input=FILE|-` reads: lines of UTF-8 text (a line that is not names its file
and line), and with `translate.format=jsonl` one JSON object a line, the source and what its translation
must start with, contain or avoid, checked and encoded as the target tokenizer encodes the output, and the
language to translate it into (`target_lang`, a multilingual model's; checked when the line is decoded)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from transformer.cli.errors import ConfigError
from transformer.inference.outputs import InferenceError
from transformer.inference.requests import PhraseEncoder, check_no_conflict
from transformer.search.constraints import TargetRequest

__all__ = ["FORMATS", "KEYS", "Entry", "EntryParser", "text_lines"]

FORMATS = ("text", "jsonl")
KEYS = ("src", "prefix", "constraints", "avoid", "target_lang")  # src required, the others optional


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
    """One JSONL input line: its number (1-based), its source text, its target request and its target
    language (None: translate.target_lang)."""

    line: int
    src: str
    request: TargetRequest
    target_lang: str | None = None


class EntryParser:
    """Parses one JSONL line into an `Entry` (`name`: the input file, or stdin, for the error lines).

    Phrases are encoded with `encode` (the target tokenizer's, BOS and EOS dropped) as the output is
    tokenized, by the inference API's `PhraseEncoder`, whose refusals (a phrase of no token, or with a
    character the tokenizer cannot encode) come back here as the line's error."""

    def __init__(
        self, name: str, encode: Callable[[str], list[int]], specials: tuple[int, int], unk_id: int | None
    ):
        self.name, self.encode, self.specials, self.unk_id = name, encode, specials, unk_id
        self._phrases = PhraseEncoder(encode, specials, unk_id)

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
        target_lang = item.get("target_lang")
        if target_lang is not None and (not isinstance(target_lang, str) or not target_lang.strip()):
            raise ConfigError(f"{where}: target_lang must be a language code (a string), got {target_lang!r}")
        prefix = item.get("prefix", "")
        if not isinstance(prefix, str):
            raise ConfigError(f"{where}: prefix must be a string, got {prefix!r}")
        try:
            request = TargetRequest(
                prefix=self._phrases.tokens(where, "prefix", prefix) if prefix.strip() else (),
                include=self._phrases.phrases(where, "constraints", item.get("constraints", [])),
                avoid=self._phrases.phrases(where, "avoid", item.get("avoid", [])),
            )
            check_no_conflict(where, request, item.get("avoid", []))
        except InferenceError as err:
            raise ConfigError(str(err)) from None
        return Entry(number, " ".join(src.split()), request, target_lang)


_EXPECTED = (
    f"translate.format=jsonl takes one JSON object a line with the keys {', '.join(KEYS)} (src required)"
)
