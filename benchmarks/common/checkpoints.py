"""A tiny translation checkpoint for the `--smoke` mode of the benchmarks that read one (bench_student,
constraints_eval, bench_decode --export-ckpt): random weights and a joint BPE trained on Multi30k's first
training lines, saved in the layout train.py writes (what `restore_model` and `load_source` read)."""

from __future__ import annotations

import gzip
from pathlib import Path

import torch

from data.tokenization import train_bpe
from transformer.config import TransformerConfig
from transformer.evaluation.restore import DATAMODULES
from transformer.model import Seq2SeqTransformer

SMOKE_LINES = 400  # Multi30k training pairs the tokenizer learns from
SMOKE_VOCAB = 300


def _lines(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [line.strip() for _, line in zip(range(n), handle)]


def smoke_checkpoint(path: Path, data_dir: str | Path, *, seed: int = 0, d_model: int = 32) -> Path:
    """Write a de -> en checkpoint of a 1+1-layer model with random weights (`seed`) to `path`."""
    data_dir = Path(data_dir)
    texts = _lines(data_dir / "train.de.gz", SMOKE_LINES) + _lines(data_dir / "train.en.gz", SMOKE_LINES)
    tokenizer = train_bpe(texts, SMOKE_VOCAB)
    vocab = tokenizer.vocab_size
    config = TransformerConfig(
        src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=d_model, n_heads=2, n_encoder_layers=1,
        n_decoder_layers=1, d_ff=2 * d_model, dropout=0.0, max_len=128,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(config).eval()
    checkpoint = {
        "state_dict": {f"model.{name}": tensor for name, tensor in model.state_dict().items()},
        "hyper_parameters": {
            "config": config.to_dict(),
            "decoding": {"beam_size": 2, "length_penalty": 0.6, "max_len_a": 0.0, "max_len_b": 8},
            "label_smoothing": 0.1,
        },
        DATAMODULES["translation"]: {"tokenizers": {"joint": tokenizer.to_json()}},
        "config": {
            "model": {"_target_": "transformer.training.TranslationTask"},
            "data": {"src_lang": "de", "tgt_lang": "en"},
        },
        "global_step": 0,
        "epoch": 0,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, path)
    return path
