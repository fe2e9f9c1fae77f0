"""A tiny one-to-many OPUS-MT directory (issue 65 item 4), made locally as `save_pretrained` writes one and as
OPUS-MT's multilingual vocabularies are built: </s> = 0, <unk> = 1, the target-language labels `>>deu<<`,
`>>fra<<`, `>>spa<<` as pieces of the shared vocabulary, then the SentencePiece pieces, <pad> last. The
SentencePiece models are trained on the synthetic task's English and German (no download, no Multi30k);
the weights are drawn at random (sharp enough that the label changes the output)."""

from __future__ import annotations

import json
from pathlib import Path

from data.synthetic import make_synthetic_splits
from tests.helpers.pretrained import EOS, UNK, spm_words, tiny_marian, train_spm

LABELS = {"deu": ">>deu<<", "fra": ">>fra<<", "spa": ">>spa<<"}
SOURCES = ["Today she buys fourteen green balls.", "Yesterday we had one dog.", "They bought one car."]


def multilingual_opus_mt_directory(directory: Path, seed: int = 0, labels: dict[str, str] = LABELS) -> Path:
    """source.spm, target.spm, vocab.json (with `labels`), tokenizer_config.json (en -> mul), config.json,
    weights and generation_config.json of a tiny MarianMTModel in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    english, german = make_synthetic_splits(seed, {"train": 800})["train"]
    train_spm(directory / "source.spm", english, 100)
    train_spm(directory / "target.spm", german, 100)
    words = spm_words(directory)
    vocab = {"</s>": EOS, "<unk>": UNK}
    for label in labels.values():
        vocab[label] = len(vocab)
    first = len(vocab)
    vocab.update((piece, first + i) for i, piece in enumerate(words))
    vocab["<pad>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    settings = {"tokenizer_class": "MarianTokenizer", "separate_vocabs": False, "source_lang": "en",
                "target_lang": "mul"}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return tiny_marian(directory, vocab, seed, eos_bias=1.0, num_beams=1, max_length=64)
