"""The `data.clean` filters one by one: what each keeps and rejects, at its boundaries, and its settings'
checks (one ValueError naming `clean.<filter>.<key>`)."""

from __future__ import annotations

import math
import sys
from collections import Counter

import pytest

from data.clean.alignment import AlignmentFilter
from data.clean.filters import (
    DuplicatesFilter,
    IdenticalFilter,
    LangidFilter,
    LengthFilter,
    MarkupFilter,
    NumbersFilter,
    RatioFilter,
    RepetitionFilter,
    ScriptFilter,
    normalize,
)


def test_length_bounds_words_chars_and_longest_word() -> None:
    f = LengthFilter(min_words=2, max_words=4, max_chars=30, max_word_chars=8)
    assert f.keep("a b", "c d e f")  # 2 and 4 words: both bounds included
    assert not f.keep("a", "c d")  # 1 word < min_words
    assert not f.keep("a b", "c d e f g")  # 5 words > max_words
    assert f.keep("abcdefgh x", "y z")  # a word of exactly max_word_chars
    assert not f.keep("abcdefghi x", "y z")  # one character more
    assert f.keep("a " * 14 + "b", "y z") is False  # 15 words
    assert not LengthFilter(max_chars=10).keep("a" * 5 + " " + "b" * 5, "y z")  # 11 characters
    assert LengthFilter(max_chars=11).keep("a" * 5 + " " + "b" * 5, "y z")
    assert not LengthFilter().keep("", "text")  # an empty side has 0 words


def test_ratio_in_characters() -> None:
    f = RatioFilter(max_ratio=2.0, min_chars=0)
    assert f.keep("x" * 10, "y" * 20)  # exactly 2.0
    assert not f.keep("x" * 10, "y" * 21)
    assert not f.keep("y" * 21, "x" * 10)  # symmetric
    assert RatioFilter(max_ratio=2.0, min_chars=11).keep("x" * 10, "y" * 50)  # shorter side not judged


def test_identical_ignores_case_spaces_and_punctuation() -> None:
    f = IdenticalFilter()
    assert not f.keep("A dog runs.", "a dog  runs")
    assert f.keep("A dog runs.", "Ein Hund rennt.")
    assert normalize("A-b, C!") == "abc"


def test_duplicates_keep_the_first_exact_and_normalized() -> None:
    f = DuplicatesFilter(normalized=True)
    assert f.keep("A dog.", "Ein Hund.")
    assert not f.keep("A dog.", "Ein Hund.")  # exact
    assert not f.keep("a dog", "EIN HUND")  # normalised: case and punctuation
    assert f.keep("A dog.", "Zwei Hunde.")  # another target
    exact = DuplicatesFilter(normalized=False)
    assert exact.keep("A dog.", "Ein Hund.") and exact.keep("a dog", "ein Hund")
    assert not exact.keep("A dog.", "Ein Hund.")
    # numbers count as one in the normalised form: the same sentence with another number is a duplicate
    numbered = DuplicatesFilter()
    assert numbered.keep("Room 12", "Zimmer 12") and not numbered.keep("Room 13", "Zimmer 13")


def test_script_letters_and_their_script() -> None:
    f = ScriptFilter(min_alpha_ratio=0.5, min_script_ratio=0.9).for_languages("en", "ru")
    assert f.keep("A dog runs.", "Собака бежит.")
    assert not f.keep("A dog runs.", "A dog runs.")  # Latin where Cyrillic is expected
    assert not f.keep("12345 678 !!", "Собака бежит.")  # too few letters
    assert f.keep("ab12", "Собака")  # exactly half letters
    unknown = ScriptFilter().for_languages("xx", "yy")  # a language without a script: letters alone
    assert unknown.keep("abc", "Собака")


def test_numbers_must_agree_as_a_multiset() -> None:
    f = NumbersFilter()
    assert f.keep("2 dogs and 3 cats", "3 Katzen und 2 Hunde")
    assert not f.keep("2 dogs", "3 Hunde")
    assert not f.keep("2 dogs", "Hunde")
    assert not f.keep("2 dogs 2 cats", "2 Hunde 3 Katzen")
    assert f.keep("no numbers", "keine Zahlen")


@pytest.mark.parametrize(
    "text",
    [
        "<p>a dog</p>",
        "a <br/> dog",
        '<a href="/x">dog</a>',
        "a &amp; b",
        "a &#39; b",
        "see http://x.org",
        "www.example.com",
        "mail me@example.org",
    ],
)
def test_markup_rejects(text: str) -> None:
    assert not MarkupFilter().keep(text, "Ein Hund.")
    assert not MarkupFilter().keep("A dog.", text)


def test_markup_keeps_plain_text_with_signs() -> None:
    assert MarkupFilter().keep("3 < 4 and 5 > 2; A & B", "Tom's dog @ home")


def test_repetition_characters_and_word_runs() -> None:
    f = RepetitionFilter(max_char_repeats=5, max_word_repeats=2)
    assert f.keep("Wow!!!!!", "ok")  # 5 in a row
    assert not f.keep("Wow!!!!!!", "ok")  # 6
    assert f.keep("a man a man walks", "ok")  # a run twice
    assert not f.keep("a man a man a man walks", "ok")  # three times
    assert not f.keep("ok", "go go go")
    assert f.keep("the dog and the cat", "ok")  # repeated words, not in a row
    assert not f.keep("one two three four five one two three four five one two three four five", "ok")


def test_langid_each_side_in_its_language() -> None:
    pytest.importorskip("py3langid")
    f = LangidFilter(min_chars=10).for_languages("en", "de")
    assert f.keep("A man is riding a bicycle down the street.", "Ein Mann fährt mit dem Fahrrad die Straße.")
    assert not f.keep(
        "Ein Mann fährt mit dem Fahrrad die Straße.", "A man is riding a bicycle down the street."
    )
    assert not f.keep("A man is riding a bicycle.", "Un homme fait du vélo dans la rue.")
    assert f.keep("Hi.", "Ein Mann fährt mit dem Fahrrad die Straße.")  # under min_chars: not judged


def test_langid_unknown_language() -> None:
    pytest.importorskip("py3langid")
    with pytest.raises(ValueError, match=r"^clean\.langid cannot check 'tlh'"):
        LangidFilter().for_languages("en", "tlh")


def _reference_alignment(
    corpus: list[tuple[str, str]], src: str, tgt: str, f: AlignmentFilter
) -> float | None:
    """The alignment score in plain Python with exact counts: leave-one-out Dice, idf-weighted mean."""
    n = len(corpus)
    sides = [[set(s.lower().split()) for s, _ in corpus], [set(t.lower().split()) for _, t in corpus]]
    count = [Counter(w for words in side for w in words) for side in sides]
    joint = Counter((a, b) for s, t in zip(*sides) for a in s for b in t)
    s_words, t_words = set(src.lower().split()), set(tgt.lower().split())
    scores = []
    for own, other, k in ((s_words, t_words, 0), (t_words, s_words, 1)):
        num = den = 0.0
        for w in own:
            c = count[k][w] - 1
            if not f.min_count <= c <= f.max_share * n:
                continue
            best = 0.0
            for o in other:
                co = count[1 - k][o] - 1
                if co >= f.min_count:
                    both = joint[(w, o) if k == 0 else (o, w)] - 1
                    best = max(best, 2 * both / max(c + co, 1))
            idf = math.log(n / (c + 1))
            num, den = num + idf * best, den + idf
        if den:
            scores.append(num / den)
    return sum(scores) / len(scores) if scores else None


def test_alignment_learns_translations_from_the_corpus() -> None:
    """Scores equal the plain-math reference; real pairs score high, unrelated ones low and are rejected;
    words of a single pair vouch for nothing (leave-one-out)."""
    lexicon = {
        "dog": "hund",
        "cat": "katze",
        "red": "rot",
        "big": "gross",
        "runs": "rennt",
        "sleeps": "schläft",
    }
    words = list(lexicon)
    corpus = [(f"{a} {b}", f"{lexicon[a]} {lexicon[b]}") for a in words for b in words if a != b] * 3
    corpus += [("dog red", "katze schläft"), ("zebra", "nashorn"), ("big zebra", "gross nashorn")]
    f = AlignmentFilter(min_score=0.3, max_share=0.5, min_count=2, table_bits=16)
    f.fit(iter(corpus))  # one pass over a generator
    for src, tgt in [("dog red", "hund rot"), ("dog red", "katze schläft"), ("big cat", "gross katze")]:
        assert f.score(src, tgt) == pytest.approx(_reference_alignment(corpus, src, tgt, f))
    assert f.score("dog red", "hund rot") > 0.5 and f.keep("dog red", "hund rot")
    assert f.score("dog red", "katze schläft") < 0.3 and not f.keep("dog red", "katze schläft")
    assert f.score("zebra", "nashorn") is None and f.keep("zebra", "nashorn")  # rare: not judged


def test_alignment_needs_fit() -> None:
    with pytest.raises(RuntimeError, match="fit"):
        AlignmentFilter().keep("a", "b")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LengthFilter(min_words=0), r"clean\.length\.min_words must be an integer >= 1, got 0"),
        (lambda: LengthFilter(min_words=5, max_words=4), r"clean\.length\.max_words must be >= min_words"),
        (lambda: RatioFilter(max_ratio=0.5), r"clean\.ratio\.max_ratio must be a number >= 1, got 0\.5"),
        (lambda: RatioFilter(max_ratio="2"), r"clean\.ratio\.max_ratio must be a number"),
        (lambda: ScriptFilter(min_alpha_ratio=1.5), r"clean\.script\.min_alpha_ratio must be a number in"),
        (lambda: RepetitionFilter(max_char_repeats=True), r"clean\.repetition\.max_char_repeats must be an"),
        (lambda: DuplicatesFilter(normalized="yes"), r"clean\.duplicates\.normalized must be true or false"),
        (lambda: LangidFilter(min_chars=-1), r"clean\.langid\.min_chars must be an integer >= 0"),
        (lambda: AlignmentFilter(min_score=2), r"clean\.alignment\.min_score must be a number in \[0, 1\]"),
        (lambda: AlignmentFilter(max_share=0), r"clean\.alignment\.max_share must be a number in \(0, 1\]"),
        (lambda: AlignmentFilter(table_bits=40), r"clean\.alignment\.table_bits must be an integer in"),
    ],
)
def test_bad_settings_name_the_key(make, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        make()


def test_langid_without_py3langid_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from data.clean import langid
    from data.sources import DataError

    langid.identifier.cache_clear()
    monkeypatch.setitem(sys.modules, "py3langid", None)  # import py3langid now raises ImportError
    monkeypatch.setitem(sys.modules, "py3langid.langid", None)
    try:
        with pytest.raises(
            DataError, match=r"^the langid filter needs py3langid: pip install 'aiayn\[clean\]'"
        ):
            LangidFilter().for_languages("en", "de")
    finally:
        langid.identifier.cache_clear()  # loaded again, for real, by the next test that needs it
