"""Issue 65 item 3: a multilingual checkpoint translates into the language asked for (`target_lang`): the
inference API puts the label in front of every source once (`data.labels.labelled_sources`), so its output
equals decoding the hand-labelled source; unknown, missing and bilingual cases are one error each."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.labels import LABELS_KEY, LanguageLabels
from tests.helpers.multilingual import (
    LABELS,
    LANGUAGES,
    SENTENCES,
    checkpoint_dict,
    multilingual_checkpoint,
    multilingual_tokenizer,
    write_checkpoint,
)
from transformer.checkpoint import load_checkpoint
from transformer.evaluation.restore import restore_model, saved_language_labels
from transformer.inference import InferenceError, Segment, Translator


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return multilingual_checkpoint(tmp_path_factory.mktemp("multilingual"))


@pytest.fixture(scope="module")
def multi(checkpoints: tuple[Path, Path]) -> Translator:
    return Translator.from_checkpoint(checkpoints[0])


@pytest.fixture(scope="module")
def twin(checkpoints: tuple[Path, Path]) -> Translator:
    return Translator.from_checkpoint(checkpoints[1])


def test_the_checkpoint_key_is_read_raw_and_restored() -> None:
    tokenizer = multilingual_tokenizer()
    checkpoint = checkpoint_dict(tokenizer, LABELS)
    assert saved_language_labels(checkpoint) == {
        "labels": {"de": ">>de<<", "fr": ">>fr<<"},
        "position": "start",
    }
    assert LanguageLabels.from_state(saved_language_labels(checkpoint)) == LABELS
    assert saved_language_labels(checkpoint_dict(tokenizer, None)) is None
    assert saved_language_labels({LABELS_KEY: {}}) is None
    assert restore_model(checkpoint).language_labels == LABELS.to_state()


def test_each_label_is_one_token_of_the_source_tokenizer(multi: Translator) -> None:
    tokenizer = multi.src_tokenizer
    for label in LABELS.tokens:
        ids = tokenizer.encode(f"{label} {SENTENCES[0]}")
        assert ids[1] == tokenizer.tokenizer.token_to_id(label)  # BOS, then the label whole
        assert ids[2:] == tokenizer.encode(SENTENCES[0])[1:]  # the rest as without it


def test_target_lang_equals_decoding_the_hand_labelled_source(multi: Translator, twin: Translator) -> None:
    outputs = {}
    for lang in ("de", "fr"):
        got = [t.text for t in multi.translate(SENTENCES, target_lang=lang)]
        expected = [t.text for t in twin.translate([f">>{lang}<< {s}" for s in SENTENCES])]
        assert got == expected
        outputs[lang] = got
    assert outputs["de"] != outputs["fr"]  # the label reaches the model


def test_a_label_at_the_end_of_the_source_goes_there(tmp_path: Path) -> None:
    """`data.labels.position=end`: the checkpoint says so, and the translator labels after the source."""
    at_end = LanguageLabels.for_languages(LANGUAGES, position="end")
    multi_path, twin_path = multilingual_checkpoint(tmp_path, labels=at_end)
    multi, twin = Translator.from_checkpoint(multi_path), Translator.from_checkpoint(twin_path)
    assert multi.labelled(SENTENCES[:1], ["fr"]) == [f"{SENTENCES[0]} >>fr<<"]
    ids = multi.src_tokenizer.encode(f"{SENTENCES[0]} >>fr<<")
    assert ids[-2] == multi.src_tokenizer.tokenizer.token_to_id(">>fr<<")  # one token, before EOS
    for lang in LANGUAGES:
        got = [t.text for t in multi.translate(SENTENCES, target_lang=lang)]
        assert got == [t.text for t in twin.translate([f"{s} >>{lang}<<" for s in SENTENCES])]


def test_per_segment_languages_mix_in_one_call(multi: Translator, twin: Translator) -> None:
    langs = ["de", "fr", "fr", "de", "fr", "de"]
    segments = [Segment(s, target_lang=lang) for s, lang in zip(SENTENCES, langs)]
    got = [t.text for t in multi.translate(segments, target_lang="de")]  # each segment's own wins
    expected = [t.text for t in twin.translate([f">>{g}<< {s}" for s, g in zip(SENTENCES, langs)])]
    assert got == expected


def test_the_translators_default_and_the_calls(checkpoints: tuple[Path, Path], twin: Translator) -> None:
    french = Translator.from_checkpoint(checkpoints[0], target_lang="fr")
    assert french.target_languages.languages == ["de", "fr"]
    assert [t.text for t in french.translate(SENTENCES[:2])] == [
        t.text for t in twin.translate([f">>fr<< {s}" for s in SENTENCES[:2]])
    ]
    assert [t.text for t in french.translate(SENTENCES[:2], target_lang="de")] == [
        t.text for t in twin.translate([f">>de<< {s}" for s in SENTENCES[:2]])
    ]


def test_n_best_prefix_and_constraints_follow_the_label(multi: Translator, twin: Translator) -> None:
    options = {"beam_size": 3, "n_best": 2}
    got = multi.translate([Segment(SENTENCES[1], target_lang="fr")], **options)
    expected = twin.translate([f">>fr<< {SENTENCES[1]}"], **options)
    assert got == expected and len(got[0].hypotheses) == 2
    prefix = expected[0].text.split()[0] if expected[0].text else "ball"
    segment = Segment(SENTENCES[2], prefix=prefix, constraints=("ball",), target_lang="de")
    got = multi.translate([segment], beam_size=3)
    expected = twin.translate(
        [Segment(f">>de<< {SENTENCES[2]}", prefix=prefix, constraints=("ball",))], beam_size=3
    )
    assert got == expected


def test_unknown_and_missing_languages_are_one_error_naming_the_valid_ones(
    checkpoints: tuple[Path, Path], multi: Translator
) -> None:
    with pytest.raises(InferenceError, match=r"^target_lang: this model is multilingual; .*: de, fr$"):
        multi.translate(SENTENCES[:1])
    with pytest.raises(InferenceError, match=r"^target_lang: unknown target language 'es'; .* de, fr$"):
        multi.translate(SENTENCES[:1], target_lang="es")
    with pytest.raises(InferenceError, match=r"^segment 1: target_lang: unknown target language 'it'"):
        multi.translate([Segment("a", target_lang="de"), Segment("b", target_lang="it")])
    with pytest.raises(InferenceError, match=r"^target_lang: unknown target language 'xx'"):
        Translator.from_checkpoint(checkpoints[0], target_lang="xx")


def test_a_bilingual_model_takes_its_own_target_and_refuses_another(twin: Translator) -> None:
    assert twin.target_languages.languages == ["de"] and not twin.target_languages.multilingual
    plain = [t.text for t in twin.translate(SENTENCES[:2])]
    assert [t.text for t in twin.translate(SENTENCES[:2], target_lang="de")] == plain
    with pytest.raises(
        InferenceError, match=r"^target_lang: 'fr' given, but this model translates into 'de'"
    ):
        twin.translate(SENTENCES[:2], target_lang="fr")
    with pytest.raises(InferenceError, match=r"^segment 0: target_lang: 'fr' given"):
        twin.translate([Segment("a", target_lang="fr")])


def test_ensemble_members_must_share_their_labels(tmp_path: Path, checkpoints: tuple[Path, Path]) -> None:
    multi, twin = checkpoints
    tokenizer = multilingual_tokenizer()
    third = write_checkpoint(
        tmp_path / "third.ckpt", checkpoint_dict(tokenizer, LanguageLabels({"de": ">>de<<"}))
    )
    with pytest.raises(InferenceError, match=rf"^checkpoint {twin} has the target-language labels none"):
        Translator.from_checkpoint([multi, twin])
    with pytest.raises(
        InferenceError, match=rf"^checkpoint {third} has the target-language labels de: >>de<< but"
    ):
        Translator.from_checkpoint([multi, third])
    second = write_checkpoint(tmp_path / "second.ckpt", checkpoint_dict(tokenizer, LABELS, seed=1))
    ensemble = Translator.from_checkpoint([multi, second], target_lang="fr")
    assert len(ensemble.translate(SENTENCES[:2])) == 2


def test_a_damaged_labels_key_is_one_error(tmp_path: Path) -> None:
    checkpoint = checkpoint_dict(multilingual_tokenizer(), LABELS)
    checkpoint[LABELS_KEY] = {"labels": {"de": "two words"}}
    path = write_checkpoint(tmp_path / "bad.ckpt", checkpoint)
    with pytest.raises(InferenceError, match=rf"^checkpoint {path}: its language_labels cannot be read"):
        Translator.from_checkpoint(path)
    assert load_checkpoint(path)[LABELS_KEY]  # nothing rewritten
