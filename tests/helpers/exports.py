"""A tiny translation model trained for the export tests (tests/unit/test_export*.py): the quickstart
task's pairs, a joint BPE, a few hundred Adam steps (enough to end its sentences), and a checkpoint in
train.py's layout."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import Tensor

from data.synthetic import generate_pair
from data.tokenization import BPETokenizer, train_bpe
from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer

MAX_LEN = 48
DECODING = {"beam_size": 1, "length_penalty": 0.6, "max_len_a": 1.2, "max_len_b": 10}


def make_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [generate_pair(rng) for _ in range(n)]


def padded_batch(tokenizer: BPETokenizer, texts: list[str]) -> Tensor:
    """(B, L) right-padded ids [BOS ... EOS] of `texts`."""
    ids = [torch.tensor(tokenizer.encode(text)) for text in texts]
    return torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=tokenizer.pad_id)


def train_tiny(
    config: TransformerConfig,
    tokenizer: BPETokenizer,
    pairs: list[tuple[str, str]],
    steps: int,
    tgt_tokenizer: BPETokenizer | None = None,
) -> Seq2SeqTransformer:
    """A few hundred Adam steps of teacher forcing: enough for the model to end its sentences
    (`tgt_tokenizer`: the targets' own, for separate vocabularies; else `tokenizer` for both sides)."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as fast for a d_model 32 model, and no thread fights on a busy machine
    try:
        _steps(model, optimizer, tokenizer, tgt_tokenizer or tokenizer, pairs, steps)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def _steps(model: Seq2SeqTransformer, optimizer: torch.optim.Optimizer, tokenizer: BPETokenizer,
           tgt_tokenizer: BPETokenizer, pairs: list[tuple[str, str]], steps: int) -> None:  # fmt: skip
    for step in range(steps):
        chunk = pairs[(step * 16) % len(pairs) :][:16]
        src = padded_batch(tokenizer, [s for s, _ in chunk])
        tgt = padded_batch(tgt_tokenizer, [t for _, t in chunk])
        logits = model(src, tgt[:, :-1])  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), tgt[:, 1:], ignore_index=tokenizer.pad_id
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def save_checkpoint(
    path: Path,
    model: torch.nn.Module,
    tokenizers: dict[str, str],
    *,
    hparams: dict | None = None,
    datamodule: str = "TranslationDataModule",
) -> Path:
    """A checkpoint in the layout train.py writes (Lightning's dict: `model.*` weights, the task's
    hyperparameters, the datamodule state with the tokenizer JSON, the resolved run config)."""
    config = model.config
    task = "TranslationTask" if datamodule == "TranslationDataModule" else "ClassificationTask"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {"config": config.to_dict(), "decoding": DECODING, **(hparams or {})},
            datamodule: {"tokenizers": tokenizers},
            "config": {
                "model": {"_target_": f"transformer.training.{task}"},
                "data": {"src_lang": "en", "tgt_lang": "de"},
            },
            "global_step": 123,
            "epoch": 4,
        },
        path,
    )
    return path


def export_config(src_vocab_size: int, **overrides: object) -> TransformerConfig:
    """The tiny exported model's shape (2+2 layers, d_model 32, no dropout), `overrides` over it (a separate
    target vocabulary, its tying)."""
    shape: dict[str, object] = dict(
        d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64, dropout=0.0, max_len=MAX_LEN
    )
    return TransformerConfig(src_vocab_size=src_vocab_size, **{**shape, **overrides})  # type: ignore[arg-type]


def trained_export_model(root: Path) -> dict:
    """A trained tiny model, its tokenizer, its checkpoint under `root`, and test sources."""
    pairs = make_pairs(600, seed=1)
    tokenizer = train_bpe([text for pair in pairs for text in pair], 400)
    config = export_config(tokenizer.vocab_size)
    model = train_tiny(config, tokenizer, pairs, steps=250)
    ckpt = save_checkpoint(root / "model.ckpt", model, {"joint": tokenizer.to_json()})
    tests = make_pairs(24, seed=2)
    return {
        "model": model,
        "tokenizer": tokenizer,
        "ckpt": ckpt,
        "root": root,
        "sources": [s for s, _ in tests],
    }
