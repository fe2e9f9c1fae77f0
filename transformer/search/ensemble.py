"""Ensembles of encoder-decoder models for decoding: each model keeps its own encoder memory and KV
cache, and at every step the ensemble's next-token distribution is the (weighted) mean of the models'
probabilities, returned as its logarithm (fairseq's ensembling). The searches in `transformer.search.decoding`
take an `Ensemble` wherever they take a `Seq2SeqTransformer`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from transformer.kv_cache import DecoderCache
from transformer.model import Seq2SeqTransformer

__all__ = ["Ensemble", "EnsembleCache"]

# The vocabulary and special tokens must agree for the models' distributions to be averaged.
_SHARED_FIELDS = ("src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id")


class EnsembleCache:
    """One `DecoderCache` per model, moved together: every row selection applies to all of them."""

    def __init__(self, caches: Sequence[DecoderCache]) -> None:
        self.caches = list(caches)

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    @property
    def beams(self) -> int:
        return self.caches[0].beams

    def reserve(self, keys: int) -> None:
        for cache in self.caches:
            cache.reserve(keys)

    def reorder(self, index: Tensor, memory_index: Tensor | None = None) -> None:
        for cache in self.caches:
            cache.reorder(index, memory_index)

    def select_beams(self, parents: Tensor, sentences: Tensor | None = None) -> None:
        for cache in self.caches:
            cache.select_beams(parents, sentences)


class Ensemble(nn.Module):
    """Models decoded as one: log of the weighted mean of their next-token probabilities.

    The models may differ in architecture (depth, width, positions) but must share the vocabularies
    and special tokens; `weights` (default: equal) are normalized to sum to 1. The ensemble's
    `config` is the first model's, with the smallest `max_len` of them all. It is built in eval mode.
    """

    def __init__(self, models: Sequence[Seq2SeqTransformer], weights: Sequence[float] | None = None) -> None:
        super().__init__()
        if not models:
            raise ValueError("an ensemble needs at least one model")
        weights = [1.0] * len(models) if weights is None else [float(w) for w in weights]
        if len(weights) != len(models):
            raise ValueError(f"ensemble_weights has {len(weights)} values for {len(models)} models")
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"ensemble_weights must be >= 0 with a positive sum, got {weights}")
        first = models[0].config
        for i, model in enumerate(models[1:], start=1):
            for name in _SHARED_FIELDS:
                if getattr(model.config, name) != getattr(first, name):
                    raise ValueError(
                        f"model {i} of the ensemble has {name}={getattr(model.config, name)}, "
                        f"model 0 has {getattr(first, name)}: the models must share vocabularies"
                    )
        self.models = nn.ModuleList(models)
        self.config = dataclasses.replace(first, max_len=min(model.config.max_len for model in models))
        total = sum(weights)
        self.log_weights = [math.log(w / total) if w > 0 else -math.inf for w in weights]  # plain floats
        self.train(False)  # for inference: the members in eval mode (no dropout), whatever they were in

    def forward(self, src: Tensor, tgt_in: Tensor, *, positions: Tensor | None = None) -> Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) -> (B, T, V) log of the weighted mean
        probability, or (N, V) at `positions` (B, T) bool only (`Seq2SeqTransformer.forward`)."""
        outputs = (model(src, tgt_in, positions=positions) for model in self.models)
        return self._mixture(outputs, 1.0)

    def _mixture(self, logits: Iterable[Tensor], temperature: float) -> Tensor:
        """Each model's (..., V) logits -> (..., V) log of the weighted mean of their softmax(logits / T),
        accumulated model by model (log-add-exp in place: no (M, ..., V) stack)."""
        mixture: Tensor | None = None
        for log_weight, model_logits in zip(self.log_weights, logits):
            log_probs = model_logits.float()
            if temperature != 1.0:
                log_probs = log_probs / temperature
            log_probs = log_probs.log_softmax(dim=-1).add_(log_weight)
            mixture = log_probs if mixture is None else torch.logaddexp(mixture, log_probs, out=mixture)
        assert mixture is not None  # at least one model (checked in __init__)
        return mixture

    def padding_mask(self, tokens: Tensor) -> Tensor:
        """tokens (B, L) long -> (B, L) bool, True where tokens == pad_id (shared by all models)."""
        return tokens.eq(self.config.pad_id)

    def encode(self, src: Tensor) -> list[Tensor]:
        """src (B, S) -> one memory (B, S, D_i) per model."""
        return [model.encode(src) for model in self.models]

    def new_cache(self) -> EnsembleCache:
        return EnsembleCache([model.new_cache() for model in self.models])

    def decode(
        self,
        tgt_in: Tensor,
        memory: list[Tensor],
        src_padding_mask: Tensor,
        cache: EnsembleCache,
        temperature: float = 1.0,
    ) -> Tensor:
        """One cached step of every model -> (B, T, V) log of the weighted mean of the models'
        probabilities, each at `temperature` (a normalized log-distribution: it also serves as logits)."""
        outputs = (
            model.decode(tgt_in, model_memory, src_padding_mask, model_cache)
            for model, model_memory, model_cache in zip(self.models, memory, cache.caches)
        )
        return self._mixture(outputs, temperature)  # (B, T, V)
