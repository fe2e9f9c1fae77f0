"""The built-in quickstart task: short English sentences with counted objects -> German.

Numbers (1-999) are written as words and must be rebuilt as German compounds with the units
before the tens ("forty-two" -> "zweiundvierzig"); nouns change gender, case and plural
("one apple" -> "einen Apfel"); a leading time adverb moves the German verb before its subject
("yesterday we bought" -> "gestern kauften wir"). Deterministic per seed, no files, no network.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

SPLITS = ("train", "val", "test")
DEFAULT_SIZES: Mapping[str, int] = {"train": 12_000, "val": 500, "test": 500}

# fmt: off
_EN_SMALL = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
             "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
             "nineteen"]
_EN_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_DE_SMALL = ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn",
             "elf", "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn",
             "neunzehn"]
_DE_TENS = ["_", "_", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig"]
# fmt: on


def number_to_english(n: int) -> str:
    """1-999 as American English words: 342 -> "three hundred forty-two"."""
    if not 0 <= n <= 999:
        raise ValueError(f"n must be in 0..999, got {n}")
    hundreds, rest = divmod(n, 100)
    words = [f"{_EN_SMALL[hundreds]} hundred"] if hundreds else []
    if rest or not hundreds:
        tens, units = divmod(rest, 10)
        if rest < 20:
            words.append(_EN_SMALL[rest])
        else:
            words.append(_EN_TENS[tens] + (f"-{_EN_SMALL[units]}" if units else ""))
    return " ".join(words)


def number_to_german(n: int) -> str:
    """1-999 as one German word: 342 -> "dreihundertzweiundvierzig", 101 -> "einhunderteins"."""
    if not 0 <= n <= 999:
        raise ValueError(f"n must be in 0..999, got {n}")
    hundreds, rest = divmod(n, 100)
    word = ("ein" if hundreds == 1 else _DE_SMALL[hundreds]) + "hundert" if hundreds else ""
    if rest or not hundreds:
        tens, units = divmod(rest, 10)
        if rest < 20:
            word += _DE_SMALL[rest]
        else:  # units first, joined by "und"; "eins" loses its s inside a compound
            word += (("ein" if units == 1 else _DE_SMALL[units]) + "und" if units else "") + _DE_TENS[tens]
    return word


@dataclass(frozen=True)
class _Noun:
    en: str
    en_plural: str
    de: str
    de_plural: str
    gender: str  # "m", "f", "n"


_NOUNS = [
    _Noun("apple", "apples", "Apfel", "Äpfel", "m"),
    _Noun("dog", "dogs", "Hund", "Hunde", "m"),
    _Noun("chair", "chairs", "Stuhl", "Stühle", "m"),
    _Noun("bird", "birds", "Vogel", "Vögel", "m"),
    _Noun("tree", "trees", "Baum", "Bäume", "m"),
    _Noun("ball", "balls", "Ball", "Bälle", "m"),
    _Noun("cat", "cats", "Katze", "Katzen", "f"),
    _Noun("flower", "flowers", "Blume", "Blumen", "f"),
    _Noun("bottle", "bottles", "Flasche", "Flaschen", "f"),
    _Noun("cup", "cups", "Tasse", "Tassen", "f"),
    _Noun("book", "books", "Buch", "Bücher", "n"),
    _Noun("house", "houses", "Haus", "Häuser", "n"),
    _Noun("car", "cars", "Auto", "Autos", "n"),
    _Noun("egg", "eggs", "Ei", "Eier", "n"),
]
# English adjective -> German stem; endings follow the accusative after "ein" or a bare number.
_ADJECTIVES = {"red": "rot", "big": "groß", "small": "klein", "old": "alt", "new": "neu", "green": "grün"}
_ACC_SINGULAR = {"m": ("einen", "en"), "f": ("eine", "e"), "n": ("ein", "es")}  # article, adjective ending

# (English subject, German subject, German person: "sg" = ich/er/sie, "pl" = wir/sie)
_SUBJECTS = [("I", "ich", "1sg"), ("he", "er", "3sg"), ("she", "sie", "3sg"), ("we", "wir", "pl"),
             ("they", "sie", "pl")]  # fmt: skip
# English present (base, 3sg), past; German present (1sg, 3sg, pl), past (sg, pl)
_VERBS = [
    ("see", "sees", "saw", "sehe", "sieht", "sehen", "sah", "sahen"),
    ("buy", "buys", "bought", "kaufe", "kauft", "kaufen", "kaufte", "kauften"),
    ("have", "has", "had", "habe", "hat", "haben", "hatte", "hatten"),
    ("sell", "sells", "sold", "verkaufe", "verkauft", "verkaufen", "verkaufte", "verkauften"),
    ("find", "finds", "found", "finde", "findet", "finden", "fand", "fanden"),
    ("paint", "paints", "painted", "male", "malt", "malen", "malte", "malten"),
    ("need", "needs", "needed", "brauche", "braucht", "brauchen", "brauchte", "brauchten"),
]


def sample_count(rng: random.Random, shares: tuple[float, float, float] = (0.1, 0.4, 0.7)) -> int:
    """A count in 1..999: 1, 2-20, 21-99 below the cumulative `shares`, else 100-999. Over-samples the
    irregular small numbers; uniform 1..999 would be mostly "x hundred y-z"."""
    bucket = rng.random()
    if bucket < shares[0]:
        return 1
    if bucket < shares[1]:
        return rng.randint(2, 20)
    if bucket < shares[2]:
        return rng.randint(21, 99)
    return rng.randint(100, 999)


def _noun_phrase(rng: random.Random) -> tuple[str, str]:
    """A counted object in the accusative: ("one old dog", "einen alten Hund")."""
    noun, count = rng.choice(_NOUNS), sample_count(rng)
    adjective = rng.choice(list(_ADJECTIVES)) if rng.random() < 0.3 else None
    if count == 1:
        article, ending = _ACC_SINGULAR[noun.gender]
        en = ["one", noun.en]
        de = [article, noun.de]
    else:
        ending = "e"  # strong plural after a bare number
        en = [number_to_english(count), noun.en_plural]
        de = [number_to_german(count), noun.de_plural]
    if adjective:
        en.insert(1, adjective)
        de.insert(1, _ADJECTIVES[adjective] + ending)
    return " ".join(en), " ".join(de)


def generate_pair(rng: random.Random) -> tuple[str, str]:
    """One (English, German) sentence pair drawn from `rng`."""
    en_subject, de_subject, person = rng.choice(_SUBJECTS)
    base, third, past, de_1sg, de_3sg, de_pl, de_past_sg, de_past_pl = rng.choice(_VERBS)
    objects = [_noun_phrase(rng) for _ in range(1 if rng.random() < 0.7 else 2)]
    en_object = " and ".join(en for en, _ in objects)
    de_object = " und ".join(de for _, de in objects)
    tense = rng.choice(["present", "past", "today", "yesterday"])
    if tense in ("present", "today"):
        en_verb = third if person == "3sg" else base
        de_verb = {"1sg": de_1sg, "3sg": de_3sg, "pl": de_pl}[person]
    else:
        en_verb = past
        de_verb = de_past_pl if person == "pl" else de_past_sg
    if tense in ("today", "yesterday"):  # German is verb-second: the adverb pushes the subject after the verb
        adverb = "heute" if tense == "today" else "gestern"
        return (
            _sentence(f"{tense} {en_subject} {en_verb} {en_object}"),
            _sentence(f"{adverb} {de_verb} {de_subject} {de_object}"),
        )
    return _sentence(f"{en_subject} {en_verb} {en_object}"), _sentence(f"{de_subject} {de_verb} {de_object}")


def _sentence(words: str) -> str:
    """Capitalized, with a full stop: detokenized text, as sacreBLEU expects."""
    return words[0].upper() + words[1:] + "."


def make_synthetic_splits(
    seed: int = 0, sizes: Mapping[str, int] | None = None
) -> dict[str, tuple[list[str], list[str]]]:
    """Disjoint splits {name: (english, german)}; no English sentence occurs twice anywhere.

    Evaluation splits are drawn first, so growing the training split keeps them unchanged.
    """
    sizes = dict(DEFAULT_SIZES if sizes is None else sizes)
    for name, size in sizes.items():
        if size < 1:
            raise ValueError(f"synthetic split {name!r} needs a positive size, got {size}")
    rng = random.Random(seed)
    seen: set[str] = set()
    order = sorted(sizes, key=lambda name: name == "train")  # train last
    splits: dict[str, tuple[list[str], list[str]]] = {}
    for name in order:
        sources: list[str] = []
        targets: list[str] = []
        while len(sources) < sizes[name]:
            source, target = generate_pair(rng)
            if source not in seen:
                seen.add(source)
                sources.append(source)
                targets.append(target)
        splits[name] = (sources, targets)
    return {name: splits[name] for name in sizes}
