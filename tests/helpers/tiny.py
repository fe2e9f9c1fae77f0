"""Tiny models the unit tests share."""

from __future__ import annotations

from typing import Any

import torch

from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer


def tiny_seq2seq(
    seed: int,
    *,
    vocab: int,
    d_model: int = 32,
    layers: int = 2,
    peaked: float = 3.0,
    max_len: int = 64,
    **overrides: Any,
) -> Seq2SeqTransformer:
    """An eval-mode Seq2SeqTransformer (4 heads, d_ff = 2 d_model, no dropout) drawn with `seed`, its output
    projection scaled by `peaked`: sharper next-token distributions, so sentences end at many lengths."""
    torch.manual_seed(seed)
    values: dict[str, Any] = {
        "src_vocab_size": vocab,
        "tgt_vocab_size": vocab,
        "d_model": d_model,
        "n_heads": 4,
        "n_encoder_layers": layers,
        "n_decoder_layers": layers,
        "d_ff": 2 * d_model,
        "dropout": 0.0,
        "max_len": max_len,
    }
    config = TransformerConfig(**{**values, **overrides})  # any field may be overridden
    model = Seq2SeqTransformer(config).eval()
    with torch.no_grad():
        model.output_projection.weight.mul_(peaked)
    return model


def tiny_sources(batch: int, *, vocab: int, seed: int = 0) -> torch.Tensor:
    """(batch, 14) long: [BOS=1, 1-11 tokens in 4 .. vocab-1, EOS=2], right-padded with 0: sources of
    different lengths in one batch."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.zeros(batch, 14, dtype=torch.long)
    for row in range(batch):
        length = int(torch.randint(1, 12, (1,), generator=generator))
        src[row, 0], src[row, length + 1] = 1, 2
        src[row, 1 : length + 1] = torch.randint(4, vocab, (length,), generator=generator)
    return src
