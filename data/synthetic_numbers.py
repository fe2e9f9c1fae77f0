"""The built-in multilingual task (`source: numbers`): who has how many of what, written out in English,
German and French ("We have forty-two apples.", "Wir haben zweiundvierzig Äpfel.", "Nous avons
quarante-deux pommes."), every direction among them.

Each split is a set of (count, noun) items, disjoint across splits, rendered in every language (with a
subject drawn per item): the test items were never seen in any direction during training. French numbers
agree with a feminine noun ("vingt et une pommes"); German has the units before the tens and the
accusative after "haben" ("einen Apfel"). Deterministic per seed, no files, no network.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from data.synthetic import number_to_english, number_to_german, sample_count

LANGUAGES = ("en", "de", "fr")
DEFAULT_SIZES: Mapping[str, int] = {"train": 3000, "val": 300, "test": 300}  # items per split
# shares of the counts 1, 2-20 and 21-99 (cumulative; the rest 100-999): fewer small ones than data.synthetic
COUNT_SHARES = (0.05, 0.3, 0.65)

# fmt: off
_FR_SMALL = ["zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf", "dix", "onze",
             "douze", "treize", "quatorze", "quinze", "seize", "dix-sept", "dix-huit", "dix-neuf"]
_FR_TENS = {2: "vingt", 3: "trente", 4: "quarante", 5: "cinquante", 6: "soixante"}
# English singular, plural; German singular, plural, gender; French singular, plural, gender
_NOUNS = [
    ("apple", "apples", "Apfel", "Äpfel", "m", "pomme", "pommes", "f"),
    ("dog", "dogs", "Hund", "Hunde", "m", "chien", "chiens", "m"),
    ("cat", "cats", "Katze", "Katzen", "f", "chat", "chats", "m"),
    ("book", "books", "Buch", "Bücher", "n", "livre", "livres", "m"),
    ("house", "houses", "Haus", "Häuser", "n", "maison", "maisons", "f"),
    ("car", "cars", "Auto", "Autos", "n", "voiture", "voitures", "f"),
    ("bird", "birds", "Vogel", "Vögel", "m", "oiseau", "oiseaux", "m"),
    ("tree", "trees", "Baum", "Bäume", "m", "arbre", "arbres", "m"),
    ("flower", "flowers", "Blume", "Blumen", "f", "fleur", "fleurs", "f"),
    ("bottle", "bottles", "Flasche", "Flaschen", "f", "bouteille", "bouteilles", "f"),
    ("chair", "chairs", "Stuhl", "Stühle", "m", "chaise", "chaises", "f"),
    ("cup", "cups", "Tasse", "Tassen", "f", "tasse", "tasses", "f"),
]
_DE_ONE = {"m": "einen", "f": "eine", "n": "ein"}  # accusative, the object of "haben"
# "to have" with each subject: English, German, French
_SUBJECTS = [
    ("I have", "Ich habe", "J'ai"),
    ("you have", "Du hast", "Tu as"),
    ("he has", "Er hat", "Il a"),
    ("she has", "Sie hat", "Elle a"),
    ("we have", "Wir haben", "Nous avons"),
    ("they have", "Sie haben", "Ils ont"),
]
# fmt: on


def number_to_french(n: int) -> str:
    """0-999 in French words (traditional spelling): 71 -> "soixante et onze", 280 -> "deux cent
    quatre-vingts", 342 -> "trois cent quarante-deux"."""
    if not 0 <= n <= 999:
        raise ValueError(f"n must be in 0..999, got {n}")
    hundreds, rest = divmod(n, 100)
    if not hundreds:
        return _french_below_100(rest)
    head = "cent" if hundreds == 1 else f"{_FR_SMALL[hundreds]} cent" + ("" if rest else "s")
    return f"{head} {_french_below_100(rest)}" if rest else head


def _french_below_100(n: int) -> str:
    if n < 20:
        return _FR_SMALL[n]
    tens, units = divmod(n, 10)
    if tens <= 6:
        return _FR_TENS[tens] + ("" if not units else " et un" if units == 1 else f"-{_FR_SMALL[units]}")
    if tens == 7:  # soixante-dix .. soixante-dix-neuf, with "et onze"
        return "soixante et onze" if n == 71 else f"soixante-{_FR_SMALL[n - 60]}"
    if n == 80:
        return "quatre-vingts"
    return f"quatre-vingt-{_FR_SMALL[n - 80]}"  # 81-99: no "et"


def render(count: int, noun: int, lang: str, subject: int = 0) -> str:
    """The item (count, noun index) with the `subject`'s "to have" in `lang`: "I have forty-two apples.",
    "Ich habe einen Apfel.", "J'ai vingt et une pommes."."""
    words = _SUBJECTS[subject][LANGUAGES.index(lang)] if lang in LANGUAGES else ""
    sentence = f"{words} {_counted(count, noun, lang)}."
    return sentence[0].upper() + sentence[1:]


def _counted(count: int, noun: int, lang: str) -> str:
    """The counted object in `lang`: "forty-two apples", "einen Apfel", "vingt et une pommes"."""
    en, en_pl, de, de_pl, de_gender, fr, fr_pl, fr_gender = _NOUNS[noun]
    if lang == "en":
        return f"one {en}" if count == 1 else f"{number_to_english(count)} {en_pl}"
    if lang == "de":
        return f"{_DE_ONE[de_gender]} {de}" if count == 1 else f"{number_to_german(count)} {de_pl}"
    if lang == "fr":
        words = number_to_french(count)
        if fr_gender == "f" and (words == "un" or words.endswith((" un", "-un"))):
            words += "e"  # "une", "vingt et une", "quatre-vingt-une"
        return f"{words} {fr if count == 1 else fr_pl}"
    raise ValueError(f"the numbers task has languages {', '.join(LANGUAGES)}, not {lang!r}")


def make_items(
    seed: int = 0, sizes: Mapping[str, int] | None = None
) -> dict[str, list[tuple[int, int, int]]]:
    """Splits of (count, noun, subject) items, disjoint in (count, noun); evaluation splits are drawn first
    (train last), so growing the training split keeps them unchanged."""
    sizes = dict(DEFAULT_SIZES if sizes is None else sizes)
    capacity = 999 * len(_NOUNS)
    if sum(sizes.values()) > capacity // 2:
        raise ValueError(
            f"the numbers task has {capacity} items; splits of {sum(sizes.values())} ask too many"
        )
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    items: dict[str, list[tuple[int, int, int]]] = {}
    for name in sorted(sizes, key=lambda name: name == "train"):
        if sizes[name] < 1:
            raise ValueError(f"numbers split {name!r} needs a positive size, got {sizes[name]}")
        chosen: list[tuple[int, int, int]] = []
        while len(chosen) < sizes[name]:
            item = (sample_count(rng, COUNT_SHARES), rng.randrange(len(_NOUNS)))
            subject = rng.randrange(len(_SUBJECTS))
            if item not in seen:
                seen.add(item)
                chosen.append((*item, subject))
        items[name] = chosen
    return {name: items[name] for name in sizes}


def make_pair_splits(
    src_lang: str, tgt_lang: str, seed: int = 0, sizes: Mapping[str, int] | None = None
) -> dict[str, tuple[list[str], list[str]]]:
    """{split: (sources, targets)} of one direction; every direction renders the same items."""
    for lang in (src_lang, tgt_lang):
        if lang not in LANGUAGES:
            raise ValueError(f"the numbers task has languages {', '.join(LANGUAGES)}, not {lang!r}")
    return {
        name: (
            [render(*item[:2], src_lang, item[2]) for item in chosen],
            [render(*item[:2], tgt_lang, item[2]) for item in chosen],
        )
        for name, chosen in make_items(seed, sizes).items()
    }
