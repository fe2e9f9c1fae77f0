"""A tiny multilingual translation checkpoint written without training (issue 65): a joint BPE tokenizer
trained with the target-language labels as special tokens (`extra_special_tokens=labels.tokens`, as the
multilingual datamodule trains it), a randomly drawn tiny model, and the checkpoint's `language_labels`
key. Untrained, so its outputs mean nothing, but they depend on the label: enough to check that a
`target_lang` reaches the model as the label token in front of the source.

`bilingual_twin` writes the same weights and tokenizer without the labels key: the reference a test decodes
a hand-labelled source with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from data.labels import LABELS_KEY, LanguageLabels
from data.tokenization import BPETokenizer, train_bpe
from tests.helpers.tiny import tiny_seq2seq

LANGUAGES = ("de", "fr")
LABELS = LanguageLabels.for_languages(LANGUAGES)
SENTENCES = [
    "a dog runs in the park .",
    "two children play with a red ball .",
    "a man is riding a bike .",
    "the woman sings a song .",
    "three people walk on the street .",
    "a little girl eats an apple .",
]
GERMAN = ["ein hund läuft im park .", "zwei kinder spielen mit einem roten ball ."]
FRENCH = ["un chien court dans le parc .", "deux enfants jouent avec un ballon rouge ."]


def multilingual_tokenizer(labels: LanguageLabels = LABELS) -> BPETokenizer:
    """A joint BPE over English, German and French text with `labels` kept whole."""
    texts = [*SENTENCES, *GERMAN, *FRENCH] * 3
    return train_bpe(texts, 120, min_frequency=1, extra_special_tokens=labels.tokens)


def checkpoint_dict(
    tokenizer: BPETokenizer, labels: LanguageLabels | None, seed: int = 0, *, src_lang: str = "en"
) -> dict[str, Any]:
    """A translation checkpoint as train.py writes one (weights, hyperparameters, config, tokenizers),
    with `labels` under `language_labels` (None: a bilingual en -> de one)."""
    model = tiny_seq2seq(seed, vocab=tokenizer.vocab_size, peaked=4.0)
    data: dict[str, Any] = {"source": "multi30k", "src_lang": src_lang, "tgt_lang": "de", "max_len": 64}
    checkpoint: dict[str, Any] = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "hyper_parameters": {
            "config": model.config.to_dict(),
            "decoding": {"beam_size": 1, "max_len_a": 1.0, "max_len_b": 3},
        },
        "global_step": 1,
        "epoch": 0,
        "config": {"model": {"_target_": "transformer.training.TranslationTask"}, "data": data},
        "tokenizers": {"joint": tokenizer.to_json()},
        "TranslationDataModule": {"tokenizers": {"joint": tokenizer.to_json()}},
    }
    if labels is not None:
        checkpoint[LABELS_KEY] = labels.to_state()
    return checkpoint


def write_checkpoint(path: Path, checkpoint: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, path)
    return path


def multilingual_checkpoint(
    directory: Path, seed: int = 0, labels: LanguageLabels = LABELS
) -> tuple[Path, Path]:
    """(the multilingual checkpoint, its bilingual twin): the same weights and tokenizer, the first with
    `labels` (by default those of LANGUAGES, at the start of the source), the second without."""
    tokenizer = multilingual_tokenizer(labels)
    multi = write_checkpoint(directory / "multi.ckpt", checkpoint_dict(tokenizer, labels, seed))
    twin = write_checkpoint(directory / "twin.ckpt", checkpoint_dict(tokenizer, None, seed))
    return multi, twin
