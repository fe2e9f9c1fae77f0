"""Encoder-only Transformers: a sequence classifier and the masked-LM model that pretrains its encoder.

Both share `_EncoderOnly` (embeddings + encoder stack) and so its parameter names, so pretrained
weights load into a classifier.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from transformer.config import TransformerConfig
from transformer.dropout import Dropout
from transformer.embedding import Embedder, build_positional, build_rotary, init_weights
from transformer.stacks import Encoder

__all__ = ["POOLINGS", "Pooling", "TransformerClassifier", "TransformerMaskedLM"]

Pooling = Literal["cls", "mean", "max", "cls_tanh", "cls_relu"]
POOLINGS: tuple[str, ...] = ("cls", "mean", "max", "cls_tanh", "cls_relu")
# a dense layer + nonlinearity on position 0 before the head: BERT's pooler (tanh), DistilBERT's
# pre-classifier (ReLU)
_POOLER_ACTIVATIONS: dict[str, type[nn.Module]] = {"cls_tanh": nn.Tanh, "cls_relu": nn.ReLU}


class _EncoderOnly(nn.Module):
    """Embeddings + encoder stack, shared by the classifier and the masked-LM pretraining model: the same
    parameter names (`src_embed.*`, `encoder.*`), so pretrained weights load into a classifier."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.src_embed = Embedder.of(
            config, nn.Embedding(config.src_vocab_size, config.d_model), build_positional(config)
        )
        self.rotary = build_rotary(config)
        self.encoder = Encoder.of(config)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) long -> hidden states (B, S, D), padding mask (B, S) True = pad."""
        padding_mask = src.eq(self.config.pad_id)  # (B, S)
        return self.encoder(self.src_embed(src), padding_mask, rotary=self.rotary), padding_mask

    def attention_maps(self, src: Tensor) -> dict[str, list[Tensor]]:
        """Per-layer encoder self-attention weights under "encoder_self", each (B, H, S, S)."""
        _, maps = self.encoder.forward_with_attention(
            self.src_embed(src), src.eq(self.config.pad_id), rotary=self.rotary
        )
        return {"encoder_self": maps}


class TransformerClassifier(_EncoderOnly):
    """Encoder-only Transformer with a linear head on a pooled representation (cf. BERT)."""

    def __init__(self, config: TransformerConfig, num_classes: int, pooling: Pooling = "cls") -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
        super().__init__(config)
        self.pooling = pooling
        if pooling in _POOLER_ACTIVATIONS:
            self.pooler = nn.Sequential(
                nn.Linear(config.d_model, config.d_model), _POOLER_ACTIVATIONS[pooling]()
            )
        self.dropout = Dropout(config.dropout)
        self.head = nn.Linear(config.d_model, num_classes)
        init_weights(self)

    def forward(self, src: Tensor) -> Tensor:
        """src (B, S) long -> logits (B, C); "cls" pools position 0 (BOS), "mean" averages the non-pad
        positions, "max" takes each feature's maximum over them (max-over-time, as in Kim, 2014);
        "cls_tanh" / "cls_relu" put position 0 through a dense layer and tanh (BERT's pooler) or ReLU
        (DistilBERT's pre-classifier) first."""
        hidden, padding_mask = self.encode(src)  # (B, S, D), (B, S)
        if self.pooling in ("cls", *_POOLER_ACTIVATIONS):
            pooled = hidden[:, 0]  # (B, D)
            if self.pooling != "cls":
                pooled = self.pooler(pooled)  # (B, D)
        elif self.pooling == "mean":
            keep = (~padding_mask).unsqueeze(-1).to(hidden.dtype)  # (B, S, 1)
            pooled = (hidden * keep).sum(1) / keep.sum(1).clamp(min=1.0)  # (B, D)
        else:  # every row has its BOS, so no row is all padding
            pooled = hidden.masked_fill(padding_mask.unsqueeze(-1), -math.inf).amax(dim=1)  # (B, D)
        return self.head(self.dropout(pooled))


class TransformerMaskedLM(_EncoderOnly):
    """Encoder-only Transformer pretrained to predict masked tokens (BERT's masked LM, Devlin et al., 2019).

    The head is BERT's: dense + GELU + LayerNorm, then the output projection tied to the input embedding
    (plus a bias). Only the encoder (`src_embed.*`, `encoder.*`) is meant to be kept for fine-tuning.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        D = config.d_model
        self.lm_transform = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D, eps=config.norm_eps))
        self.lm_bias = nn.Parameter(torch.zeros(config.src_vocab_size))
        init_weights(self)

    def forward(self, src: Tensor, positions: Tensor) -> Tensor:
        """src (B, S) long with some tokens masked, positions (B, S) bool: where to predict ->
        logits (N, V) over the vocabulary for the N positions, in row-major order."""
        hidden, _ = self.encode(src)  # (B, S, D)
        selected = self.lm_transform(hidden[positions])  # (N, D)
        return nn.functional.linear(selected, self.src_embed.embedding.weight, self.lm_bias)  # (N, V)
