"""The filters of parallel-data cleaning: each judges one (source, target) pair, True = keep.

Each is a small dataclass whose fields are its settings (their defaults are the documented ones,
docs/data.md#cleaning), checked in `__post_init__` with a ValueError naming `<filter>.<key>`. They follow
OpusFilter's filters of the same purpose (LengthFilter, LengthRatioFilter, LongWordFilter,
AlphabetRatioFilter / CharacterScoreFilter, NonZeroNumeralsFilter, RepetitionFilter, DuplicateFilter,
LanguageIDFilter), written here without OpusFilter's dependencies (docs/data.md says why).
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from data.clean.langid import check_language, classify, identifier


class PairFilter:
    """A filter of pairs; `name` is its key under `data.clean`."""

    name: ClassVar[str]

    def keep(self, src: str, tgt: str) -> bool:
        raise NotImplementedError

    def fit(self, pairs: Iterable[tuple[str, str]]) -> None:
        """A first pass over the corpus, for filters that learn from it (`alignment`); most need none."""

    def settings(self) -> dict[str, Any]:
        """Its settings as plain data (they key the prepared-data cache and head the report)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}  # type: ignore[arg-type]

    def _check(self, key: str, ok: bool, expected: str) -> None:
        if not ok:
            raise ValueError(f"clean.{self.name}.{key} must be {expected}, got {getattr(self, key)!r}")

    def _check_int(self, key: str, minimum: int) -> None:
        value = getattr(self, key)
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
        self._check(key, ok, f"an integer >= {minimum}")

    def _check_number(self, key: str, low: float, high: float, expected: str) -> None:
        value = getattr(self, key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
        self._check(key, ok, expected)


@dataclass
class LengthFilter(PairFilter):
    """Words (whitespace-separated) and characters per side within bounds; no word longer than
    `max_word_chars` (a URL, a base64 blob, words glued together)."""

    name: ClassVar[str] = "length"
    min_words: int = 1
    max_words: int = 100
    max_chars: int = 1000
    max_word_chars: int = 40

    def __post_init__(self) -> None:
        for key in ("min_words", "max_words", "max_chars", "max_word_chars"):
            self._check_int(key, 1)
        self._check("max_words", self.max_words >= self.min_words, f">= min_words ({self.min_words})")

    def keep(self, src: str, tgt: str) -> bool:
        for text in (src, tgt):
            if len(text) > self.max_chars:
                return False
            words = text.split()
            if not self.min_words <= len(words) <= self.max_words:
                return False
            if max(map(len, words)) > self.max_word_chars:
                return False
        return True


@dataclass
class RatioFilter(PairFilter):
    """The longer side at most `max_ratio` times the shorter, in characters (a truncated or padded side);
    pairs whose shorter side has fewer than `min_chars` characters are not judged."""

    name: ClassVar[str] = "ratio"
    max_ratio: float = 2.0
    min_chars: int = 0

    def __post_init__(self) -> None:
        self._check_number("max_ratio", 1.0, float("inf"), "a number >= 1")
        self._check_int("min_chars", 0)

    def keep(self, src: str, tgt: str) -> bool:
        short, long = sorted((len(src), len(tgt)))
        return short < self.min_chars or long <= self.max_ratio * short


@dataclass
class IdenticalFilter(PairFilter):
    """Source and target differ once case, spaces and punctuation are ignored (an untranslated copy)."""

    name: ClassVar[str] = "identical"

    def keep(self, src: str, tgt: str) -> bool:
        return normalize(src) != normalize(tgt)


@dataclass
class DuplicatesFilter(PairFilter):
    """The first of duplicate pairs is kept: exact duplicates, or with `normalized` pairs equal once case,
    spaces, punctuation and digits are ignored. Memory: one 8-byte digest per distinct pair (a Python
    set: about 70 bytes each, 70 MB for 1M pairs), never the texts."""

    name: ClassVar[str] = "duplicates"
    normalized: bool = True
    _seen: set[bytes] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self._check("normalized", isinstance(self.normalized, bool), "true or false")

    def keep(self, src: str, tgt: str) -> bool:
        if self.normalized:
            src, tgt = normalize(src, digits=True), normalize(tgt, digits=True)
        digest = hashlib.blake2b(f"{src}\t{tgt}".encode(), digest_size=8).digest()
        if digest in self._seen:
            return False
        self._seen.add(digest)
        return True


@dataclass
class ScriptFilter(PairFilter):
    """Mostly letters (`min_alpha_ratio` of the non-space characters) and those letters in the script of
    the side's language (`min_script_ratio`, e.g. Latin for en / de / fr, Cyrillic for ru)."""

    name: ClassVar[str] = "script"
    min_alpha_ratio: float = 0.5
    min_script_ratio: float = 0.9
    _scripts: tuple[str | None, str | None] = field(default=(None, None), repr=False)

    def __post_init__(self) -> None:
        for key in ("min_alpha_ratio", "min_script_ratio"):
            self._check_number(key, 0.0, 1.0, "a number in [0, 1]")

    def for_languages(self, src_lang: str, tgt_lang: str) -> ScriptFilter:
        self._scripts = (script_of(src_lang), script_of(tgt_lang))
        return self

    def keep(self, src: str, tgt: str) -> bool:
        return all(self._side_ok(text, script) for text, script in zip((src, tgt), self._scripts))

    def _side_ok(self, text: str, script: str | None) -> bool:
        chars = [c for c in text if not c.isspace()]
        letters = [c for c in chars if c.isalpha()]
        if not chars or len(letters) < self.min_alpha_ratio * len(chars):
            return False
        if script is None or not letters:  # a language without a known script: letters alone
            return True
        in_script = sum(_script_name(c) == script for c in letters)
        return in_script >= self.min_script_ratio * len(letters)


@dataclass
class NumbersFilter(PairFilter):
    """The same numbers (digit sequences, as a multiset) on both sides."""

    name: ClassVar[str] = "numbers"

    def keep(self, src: str, tgt: str) -> bool:
        return Counter(_NUMBER.findall(src)) == Counter(_NUMBER.findall(tgt))


@dataclass
class MarkupFilter(PairFilter):
    """No URLs, e-mail addresses, HTML / XML tags or character entities on either side."""

    name: ClassVar[str] = "markup"

    def keep(self, src: str, tgt: str) -> bool:
        return not (_MARKUP.search(src) or _MARKUP.search(tgt))


@dataclass
class RepetitionFilter(PairFilter):
    """No character repeated more than `max_char_repeats` times in a row, no run of 1 to 5 words repeated
    more than `max_word_repeats` times in a row (boilerplate, a stuck crawler, a looping translation)."""

    name: ClassVar[str] = "repetition"
    max_char_repeats: int = 5
    max_word_repeats: int = 2

    def __post_init__(self) -> None:
        self._check_int("max_char_repeats", 1)
        self._check_int("max_word_repeats", 1)
        self._chars = re.compile(rf"(\S)\1{{{self.max_char_repeats},}}")
        self._words = re.compile(rf"(?<!\S)((?:\S+\s+){{1,5}}?)\1{{{self.max_word_repeats},}}")

    def keep(self, src: str, tgt: str) -> bool:
        # a trailing space lets the last word of a run match `\S+\s+` too
        return not any(self._chars.search(t) or self._words.search(f"{t} ") for t in (src, tgt))


@dataclass
class LangidFilter(PairFilter):
    """Each side identified as its language by py3langid (a model shipped in the package); sides with
    fewer than `min_chars` characters are not judged (too short to tell)."""

    name: ClassVar[str] = "langid"
    min_chars: int = 10
    _langs: tuple[str, str] = field(default=("", ""), repr=False)

    def __post_init__(self) -> None:
        self._check_int("min_chars", 0)

    def for_languages(self, src_lang: str, tgt_lang: str) -> LangidFilter:
        self._langs = (check_language(src_lang), check_language(tgt_lang))
        identifier()  # loaded now: a missing package fails before any data is read
        return self

    def keep(self, src: str, tgt: str) -> bool:
        return all(
            len(text) < self.min_chars or classify(text) == lang
            for text, lang in zip((src, tgt), self._langs)
        )


_NUMBER = re.compile(r"\d+")
_MARKUP = re.compile(
    r"https?://|www\.\w|\b[\w.+-]+@[\w-]+\.\w|</?[A-Za-z][A-Za-z0-9]*(?:\s[^<>]*)?/?>|&(?:#\d+|#x[\da-fA-F]+|[A-Za-z]+);"
)
_PUNCTUATION = re.compile(r"[\W_]+")
_DIGITS = re.compile(r"\d+")

# the Unicode name prefix of each script's letters, by ISO 639-1 code (a language not listed: letters alone)
_SCRIPTS = {
    "LATIN": "af ca cs cy da de en eo es et eu fi fr ga gl hr hu id is it lt lv ms mt nl no pl pt ro sk sl "
    "sq sv sw tl tr vi",
    "CYRILLIC": "be bg kk mk mn ru sr uk",
    "GREEK": "el",
    "ARABIC": "ar fa ps ur",
    "HEBREW": "he",
    "DEVANAGARI": "hi mr ne",
    "HANGUL": "ko",
    "GEORGIAN": "ka",
    "ARMENIAN": "hy",
    "THAI": "th",
}
_SCRIPT_OF = {lang: script for script, langs in _SCRIPTS.items() for lang in langs.split()}


@functools.cache
def _script_name(char: str) -> str:
    """The first word of a character's Unicode name ("LATIN", "CYRILLIC", ...), looked up once per char."""
    return unicodedata.name(char, "").split(" ", 1)[0]


def script_of(lang: str) -> str | None:
    """The Unicode script name prefix of `lang`'s letters (e.g. "LATIN"), None when not in the table."""
    return _SCRIPT_OF.get(lang.split("_")[0].split("-")[0].lower())


def normalize(text: str, digits: bool = False) -> str:
    """Lower case without punctuation and spaces (and, with `digits`, with every number as 0)."""
    text = _PUNCTUATION.sub("", text.casefold())
    return _DIGITS.sub("0", text) if digits else text
