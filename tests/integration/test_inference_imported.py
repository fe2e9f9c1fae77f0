"""The inference API on models imported by `aiayn-import`: a tiny OPUS-MT model (`tests.helpers.pretrained`)
translates as transformers' `generate` does (greedy, as tests/integration/test_import.py establishes for
evaluate.py), and a tiny BERT classifier gives transformers' class probabilities; both checkpoints carry
their tokenizers under the checkpoint's own key."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.pretrained import bert_directory, multi30k_lines, opus_mt_directory, sst2_lines  # noqa: E402
from transformer.checkpoint import load_checkpoint  # noqa: E402
from transformer.inference import Classifier, Translator, load  # noqa: E402
from transformer.interop.import_cli import main  # noqa: E402

pytestmark = pytest.mark.slow
N_SENTENCES = 30


def test_an_imported_opus_mt_model_translates_as_transformers_does(tmp_path: Path) -> None:
    data = data_dir("MULTI30K_DIR")
    source = opus_mt_directory(tmp_path / "opus-mt-de-en", data)
    assert main([str(source), "--output", str(tmp_path / "imported")]) == 0
    checkpoint = tmp_path / "imported" / "model.ckpt"
    saved = load_checkpoint(checkpoint)
    assert saved["tokenizers"] is saved["TranslationDataModule"]["tokenizers"]
    translator = load(checkpoint)
    assert isinstance(translator, Translator) and translator.languages == ("de", "en")
    sources = multi30k_lines(data, "test_2016_flickr.de.gz", N_SENTENCES)
    ours = [t.text for t in translator.translate(sources, beam_size=1, max_len_a=0, max_len_b=20)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses" (a normalizer not used here)
        tokenizer = transformers.MarianTokenizer.from_pretrained(source)
    marian = transformers.MarianMTModel.from_pretrained(source).eval()
    batch = tokenizer(sources, return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = marian.generate(**batch, num_beams=1, max_new_tokens=20, do_sample=False)
    assert ours == tokenizer.batch_decode(generated, skip_special_tokens=True)
    assert len(set(ours)) >= 3  # random weights: a few distinct outputs, not one repeated string


def test_an_imported_bert_classifies_as_transformers_does(tmp_path: Path) -> None:
    sst2 = data_dir("SST2_DIR")
    source = bert_directory(tmp_path / "bert", sst2, num_labels=2)
    assert main([str(source), "--output", str(tmp_path / "imported")]) == 0
    checkpoint = tmp_path / "imported" / "model.ckpt"
    classifier = Classifier.from_checkpoint(checkpoint)
    model = transformers.BertForSequenceClassification.from_pretrained(source).eval()
    assert classifier.labels == [model.config.id2label[i] for i in range(2)]
    texts = sst2_lines(sst2, "dev", N_SENTENCES)
    predictions = classifier.predict(texts)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    with torch.no_grad():
        expected = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits.softmax(-1)
    ours = torch.tensor([[p.probabilities[name] for name in classifier.labels] for p in predictions])
    assert (ours - expected).abs().max().item() < 1e-5
    assert [classifier.labels.index(p.label) for p in predictions] == expected.argmax(-1).tolist()
