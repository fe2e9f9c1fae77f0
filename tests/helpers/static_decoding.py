"""Tiny models and searches to compare the static and compiled KV caches with the growing one."""

from __future__ import annotations

from typing import Any

import torch

import transformer.search.compiled as compiled
import transformer.search.static_cache as static_cache
from tests.helpers.tiny import tiny_seq2seq, tiny_sources
from transformer.model import Seq2SeqTransformer
from transformer.search.decoding import DecodingSettings, search

VOCAB = 24
SEARCHES = {
    "greedy": {"beam_size": 1},
    "beam4_nbest": {"beam_size": 4, "n_best": 4},
    "sample": {"search": "sample", "top_k": 5, "top_p": 0.9, "n_best": 2},
    "constrained_beam": {"beam_size": 4, "min_len": 3, "no_repeat_ngram_size": 2},
    "constrained_greedy": {"beam_size": 1, "min_len": 4, "no_repeat_ngram_size": 2},
}


def seq2seq(seed: int, d_model: int = 32, layers: int = 2, **overrides: Any) -> Seq2SeqTransformer:
    """A tiny model of VOCAB words (tests/helpers/tiny.py) from `seed`."""
    return tiny_seq2seq(seed, vocab=VOCAB, d_model=d_model, layers=layers, **overrides)


def sources(batch: int, seed: int = 0) -> torch.Tensor:
    """(batch, 14) source ids of VOCAB words, right-padded (tests/helpers/tiny.py)."""
    return tiny_sources(batch, vocab=VOCAB, seed=seed)


def decoded(
    model: Any, src: torch.Tensor, kv_cache: str, **settings: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and scores of one search with this KV cache (at most 20 tokens unless `settings` say)."""
    settings = {"max_len_b": 20, **settings}
    return search(
        model, src, DecodingSettings(kv_cache=kv_cache, **settings), torch.Generator().manual_seed(7)
    )


def assert_same(expected: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Token for token; scores equal up to float32 summation order (attention sums over the C slots)."""
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-5)  # -inf where expected has -inf


def fresh_compilation() -> None:
    """A clean Dynamo cache, a new compiled step and new bucket buffers (process-wide otherwise)."""
    torch._dynamo.reset()
    compiled._compile_step.cache_clear()
    static_cache._bucket_buffers.cache_clear()


def widen(src: torch.Tensor, width: int) -> torch.Tensor:
    """src (B, 14) right-padded to (B, width): the same sentences in a wider batch."""
    return torch.nn.functional.pad(src, (0, width - src.shape[1]), value=0)
