"""data/labels.py: target-language labels, their errors and their checkpoint state."""

import re

import pytest

from data.labels import LABELS_KEY, LabelError, LanguageLabels, labelled_sources


def test_labels_are_spelled_by_the_format_in_language_order() -> None:
    labels = LanguageLabels.for_languages(["fr", "de", "fr"])
    assert labels.labels == {"de": ">>de<<", "fr": ">>fr<<"}
    assert labels.tokens == [">>de<<", ">>fr<<"]
    assert LanguageLabels.for_languages(["de"], "<2{lang}>").labels == {"de": "<2de>"}
    assert labels.labelled("A dog.", "fr") == ">>fr<< A dog."


def test_the_label_goes_at_the_start_or_the_end_of_the_source() -> None:
    at_end = LanguageLabels.for_languages(["de", "fr"], position="end")
    assert at_end.labelled("A dog.", "fr") == "A dog. >>fr<<"
    assert labelled_sources(["a", "b"], ["de", "fr"], at_end) == ["a >>de<<", "b >>fr<<"]
    with pytest.raises(ValueError, match="position must be one of start, end, got 'middle'"):
        LanguageLabels({"de": ">>de<<"}, "middle")  # type: ignore[arg-type]


def test_state_round_trips_and_a_bilingual_checkpoint_has_none() -> None:
    for position in ("start", "end"):
        labels = LanguageLabels.for_languages(["de", "fr"], position=position)  # type: ignore[arg-type]
        assert labels.to_state()["position"] == position
        assert LanguageLabels.from_state(labels.to_state()) == labels
    assert LanguageLabels.from_state(None) is None
    # written before the position was a choice (and by an OPUS-MT import): the label goes first
    assert LanguageLabels.from_state({"labels": {"de": ">>de<<"}}).position == "start"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("lang", "message"),
    [
        (None, "choose a target language: de, fr"),
        ("es", "unknown target language 'es'; this model knows de, fr"),
    ],
)
def test_a_missing_or_unknown_language_names_the_valid_ones(lang: str | None, message: str) -> None:
    with pytest.raises(LabelError, match=message):
        LanguageLabels.for_languages(["de", "fr"]).label(lang, "translate.target_lang")


def test_bad_formats_and_labels_are_refused() -> None:
    with pytest.raises(ValueError, match="must contain"):
        LanguageLabels.for_languages(["de"], ">>xx<<")
    with pytest.raises(
        ValueError, match=r"^a label format must spell one word \(no spaces\), got '>> \{lang\} <<'$"
    ):
        LanguageLabels.for_languages(["de"], ">> {lang} <<")
    with pytest.raises(ValueError, match=re.escape("no other {field}, got '<{lang}{x}>'")):
        LanguageLabels.for_languages(["de"], "<{lang}{x}>")
    with pytest.raises(ValueError, match="one word"):
        LanguageLabels({"de": ">> de <<"})
    with pytest.raises(ValueError, match="at least one"):
        LanguageLabels({})


def test_labelled_sources_for_multilingual_and_bilingual_models() -> None:
    labels = LanguageLabels.for_languages(["de", "fr"])
    assert labelled_sources(["a", "b"], ["de", "fr"], labels) == [">>de<< a", ">>fr<< b"]
    with pytest.raises(LabelError, match="line 2"):
        labelled_sources(["a", "b"], ["de", None], labels, where="line 2")
    # a bilingual model: its own target is ignored, as is any language when its target is unknown
    assert labelled_sources(["a"], ["en"], None, bilingual_target="en") == ["a"]
    assert labelled_sources(["a"], ["fr"], None) == ["a"]
    with pytest.raises(LabelError, match="translates into 'en' only"):
        labelled_sources(["a"], ["fr"], None, bilingual_target="en")


def test_data_and_evaluation_name_the_same_checkpoint_key() -> None:
    """data/ and transformer/evaluation/ may not import each other, so each names the key: they agree."""
    from transformer.evaluation.restore import LANGUAGE_LABELS_KEY

    assert LANGUAGE_LABELS_KEY == LABELS_KEY == "language_labels"
