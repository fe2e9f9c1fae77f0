"""Issue 65 item 3 on the CTranslate2 backend and the export: the labels are tokens of the vocabulary the
export writes, so CTranslate2 translates a multilingual checkpoint (tests/helpers/multilingual.py) into the
language asked for exactly as the torch backend does (greedy: the same texts and scores), labelled by the
same function; a server model on this backend checks `target_lang` as the torch one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.helpers.multilingual import LABELS, SENTENCES, multilingual_checkpoint
from tests.helpers.serving import settings
from transformer.inference import CTranslate2Translator, InferenceError, Segment, Translator
from transformer.serving.app import create_app

ctranslate2 = pytest.importorskip("ctranslate2")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return multilingual_checkpoint(tmp_path_factory.mktemp("multilingual"))[0]


@pytest.fixture(scope="module")
def both(checkpoint: Path) -> tuple[Translator, CTranslate2Translator]:
    return Translator.from_checkpoint(checkpoint), CTranslate2Translator.from_checkpoint(checkpoint)


def test_the_converted_vocabulary_holds_the_labels(both: tuple[Translator, CTranslate2Translator]) -> None:
    converted = both[1].directory
    words = json.loads((converted / "shared_vocabulary.json").read_text(encoding="utf-8"))
    for label in LABELS.tokens:
        assert label in words


def test_the_transformers_export_keeps_the_labels_whole(checkpoint: Path, tmp_path: Path) -> None:
    """aiayn-export --to hf of a multilingual BPE model: the fast tokenizer keeps each label one token (our
    ids for a labelled text), MarianMTModel scores the labelled source as ours, and the card lists them."""
    from transformers import AutoTokenizer

    from transformer.interop.export_hf import export_hf
    from transformer.interop.source import load_source

    source = load_source(checkpoint)
    export_hf(source, tmp_path / "hf")  # checks the log-probabilities of the files loaded back
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = Translator.from_checkpoint(checkpoint).src_tokenizer
    for label in LABELS.tokens:
        for text in SENTENCES:
            assert exported(f"{label} {text}").input_ids == ours.encode(f"{label} {text}")
    card = (tmp_path / "hf" / "README.md").read_text(encoding="utf-8")
    assert (
        "multilingual: 2 target languages, chosen by a label at the start of the source: `>>de<<` (de)"
        in card
    )


def test_ctranslate2_equals_torch_in_every_language(both: tuple[Translator, CTranslate2Translator]) -> None:
    torch_, ct2 = both
    outputs = {}
    for lang in ("de", "fr"):
        ours = torch_.translate(SENTENCES, target_lang=lang)
        theirs = ct2.translate(SENTENCES, target_lang=lang)
        assert [t.text for t in theirs] == [t.text for t in ours]
        assert [t.score for t in theirs] == pytest.approx([t.score for t in ours], abs=1e-4)
        outputs[lang] = [t.text for t in ours]
    assert outputs["de"] != outputs["fr"]
    mixed = [Segment(s, target_lang=g) for s, g in zip(SENTENCES, ["de", "fr"] * 3)]
    assert [t.text for t in ct2.translate(mixed)] == [t.text for t in torch_.translate(mixed)]


def test_the_same_errors(checkpoint: Path, both: tuple[Translator, CTranslate2Translator]) -> None:
    ct2 = both[1]
    with pytest.raises(InferenceError, match=r"^target_lang: this model is multilingual; .*: de, fr$"):
        ct2.translate(SENTENCES[:1])
    with pytest.raises(InferenceError, match=r"^segment 0: target_lang: unknown target language 'es'"):
        ct2.translate([Segment("a", target_lang="es")])
    assert ct2.target_languages.languages == ["de", "fr"]


def test_served_on_ctranslate2(checkpoint: Path, both: tuple[Translator, CTranslate2Translator]) -> None:
    torch_, ct2 = both
    app = create_app(settings({"ct2": str(checkpoint)}), {"ct2": ct2})
    with TestClient(app) as client:
        [entry] = client.get("/v1/models").json()["models"]
        assert entry["target_languages"] == ["de", "fr"] and entry["multilingual"] is True
        response = client.post(
            "/v1/translate", json={"model": "ct2", "segments": SENTENCES[:2], "target_lang": "fr"}
        )
        assert [t["translation"] for t in response.json()["translations"]] == [
            t.text for t in torch_.translate(SENTENCES[:2], target_lang="fr")
        ]
        response = client.post("/v1/translate", json={"model": "ct2", "segments": ["a"], "target_lang": "xx"})
        assert response.status_code == 422 and response.json()["error"]["field"] == "target_lang"
