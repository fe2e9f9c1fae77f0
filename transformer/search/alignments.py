"""Word alignments from cross-attention (Garg et al., 2019: the penultimate decoder layer's attention,
averaged over heads, aligns well without any alignment training).

The weights come from one teacher-forced pass over the finished hypotheses, not from the search's steps:
the decoder is causal, so the query that produced token t sees the same prefix and gives the same
weights as during the search, and the search itself (its one step, its caches, the training path) carries
no attention weights at all. One pass per batch, all hypotheses of a sentence together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from transformer.search.ensemble import Ensemble
from transformer.search.step import Searchable, eval_mode

__all__ = ["cross_attention", "word_alignment"]


def cross_attention(model: Searchable, src: Tensor, hypotheses: Tensor, layer: int) -> Tensor:
    """src (B, S), hypotheses (B, T) (the tokens after BOS, EOS-terminated, pad-filled) -> (B, T, S)
    float: decoder layer `layer`'s (negative: from the top) cross-attention at the step that produced
    each token, averaged over heads. An ensemble's alignments are its first model's."""
    member = model.models[0] if isinstance(model, Ensemble) else model
    layers = member.config.n_decoder_layers
    if not -layers <= layer < layers:
        raise ValueError(f"decode.alignment_layer={layer}, but the model has {layers} decoder layers")
    bos = hypotheses.new_full((hypotheses.shape[0], 1), member.config.bos_id)
    tgt_in = torch.cat([bos, hypotheses[:, :-1]], dim=1)  # (B, T): the input of the step producing each
    with eval_mode(member):
        weights = member.attention_maps(src, tgt_in)["cross"][layer]  # (B, H, T, S)
    return weights.float().mean(dim=1)  # (B, T, S)


def word_alignment(
    attention: Tensor, src_words: Sequence[int], tgt_words: Sequence[int]
) -> list[tuple[int, int]]:
    """One hypothesis' attention (T, S) and the word index of each target / source token (-1: a token
    of no word: BOS, EOS, padding) -> (source word, target word) pairs, one per target word: the source
    word whose tokens its tokens attend to most (attention summed over the source word's tokens and
    over the target word's tokens)."""
    tgt = torch.tensor(list(tgt_words)[: attention.shape[0]], dtype=torch.long)
    src = torch.tensor(list(src_words)[: attention.shape[1]], dtype=torch.long)
    if not (tgt >= 0).any() or not (src >= 0).any():
        return []
    weights = attention[: len(tgt), : len(src)][tgt >= 0][:, src >= 0]  # (t, s) the words' tokens only
    n_tgt, n_src = int(tgt.max()) + 1, int(src.max()) + 1
    per_target = torch.zeros(n_tgt, weights.shape[1]).index_add_(0, tgt[tgt >= 0], weights)  # (Tw, s)
    per_word = torch.zeros(n_src, n_tgt).index_add_(0, src[src >= 0], per_target.T)  # (Sw, Tw)
    present = torch.zeros(n_tgt, dtype=torch.bool).index_fill_(0, tgt[tgt >= 0], True)
    best = per_word.argmax(dim=0)  # (Tw,)
    return [(int(best[j]), j) for j in range(n_tgt) if present[j]]
