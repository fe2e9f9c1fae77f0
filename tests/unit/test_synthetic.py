"""The built-in synthetic task: correct German numbers, deterministic, disjoint splits, non-trivial."""

import random

import pytest

from data.synthetic import generate_pair, make_synthetic_splits, number_to_english, number_to_german

NUMBERS = {
    1: ("one", "eins"),
    7: ("seven", "sieben"),
    11: ("eleven", "elf"),
    16: ("sixteen", "sechzehn"),
    17: ("seventeen", "siebzehn"),
    21: ("twenty-one", "einundzwanzig"),
    30: ("thirty", "dreißig"),
    37: ("thirty-seven", "siebenunddreißig"),
    66: ("sixty-six", "sechsundsechzig"),
    100: ("one hundred", "einhundert"),
    101: ("one hundred one", "einhunderteins"),
    121: ("one hundred twenty-one", "einhunderteinundzwanzig"),
    342: ("three hundred forty-two", "dreihundertzweiundvierzig"),
    716: ("seven hundred sixteen", "siebenhundertsechzehn"),
    999: ("nine hundred ninety-nine", "neunhundertneunundneunzig"),
}


@pytest.mark.parametrize(("n", "words"), NUMBERS.items())
def test_number_words(n: int, words: tuple[str, str]) -> None:
    assert (number_to_english(n), number_to_german(n)) == words


def test_number_out_of_range() -> None:
    with pytest.raises(ValueError, match="1000"):
        number_to_german(1000)


def test_deterministic_per_seed() -> None:
    sizes = {"train": 300, "val": 50, "test": 50}
    assert make_synthetic_splits(3, sizes) == make_synthetic_splits(3, sizes)
    assert make_synthetic_splits(3, sizes)["train"] != make_synthetic_splits(4, sizes)["train"]


def test_splits_disjoint_sized_and_stable() -> None:
    splits = make_synthetic_splits(0, {"train": 2000, "val": 200, "test": 200})
    assert {name: len(src) for name, (src, tgt) in splits.items()} == {"train": 2000, "val": 200, "test": 200}
    sets = {name: set(src) for name, (src, _) in splits.items()}
    assert len(sets["train"]) == 2000  # no duplicates within a split either
    assert (
        not sets["train"] & sets["val"]
        and not sets["train"] & sets["test"]
        and not sets["val"] & sets["test"]
    )
    # Evaluation splits are drawn first: a bigger training split leaves them unchanged.
    bigger = make_synthetic_splits(0, {"train": 3000, "val": 200, "test": 200})
    assert bigger["val"] == splits["val"] and bigger["test"] == splits["test"]


def test_non_trivial_and_modest_length() -> None:
    src, tgt = make_synthetic_splits(0, {"train": 3000})["train"]
    src_words = [len(s.split()) for s in src]
    assert min(src_words) >= 4 and max(src_words) <= 20 and len(set(src_words)) >= 8
    pairs = dict(zip(src, tgt))
    # Reordering: verb before subject after a time adverb; units before tens inside numbers.
    inverted = [s for s in src if s.startswith("Yesterday we ")]
    assert inverted and all(pairs[s].split()[2] == "wir" for s in inverted)
    # Gender and case: "one X" becomes einen / eine / ein depending on the noun.
    articles = set()
    for s in src:
        words = pairs[s].split()
        articles |= {words[words.index(noun) - 1] for noun in ("Apfel", "Katze", "Buch") if noun in words}
    assert {"einen", "eine", "ein"} <= articles


def test_generate_pair_uses_only_rng() -> None:
    assert generate_pair(random.Random(5)) == generate_pair(random.Random(5))


def test_bad_size() -> None:
    with pytest.raises(ValueError, match="val"):
        make_synthetic_splits(0, {"train": 10, "val": 0})
