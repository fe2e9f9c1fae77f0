"""One hypothesis per row: greedy search (the argmax of each step) and sampling (a `Sampler`'s draw), over
the shared step (`transformer.search.step.next_log_probs`). Rows that finish leave the decoder batch
(or, with a static cache, stay masked); each step reads back one number, how many rows still decode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from transformer.search.static_cache import Stepping
from transformer.search.step import LengthLimits, LengthNormalizer, Sampler, Searchable, StepRules


def argmax(log_probs: Tensor) -> Tensor:
    return log_probs.max(dim=-1).indices  # (N,) the first of ties; 2-3x faster than argmax on CPU


def samples(
    model: Searchable,
    src: Tensor,
    rules: StepRules,
    sampler: Sampler,
    n_best: int,
    penalty: LengthNormalizer,
    lengths: Mapping[str, float],
    stepping: Stepping,
) -> tuple[Tensor, Tensor]:
    """n_best samples per sentence (each source repeated n_best times), sorted best first."""
    batch = src.size(0)
    if rules.constraints is not None:
        rules.constraints.repeat(n_best)
    tokens, scores = row_search(
        model,
        src.repeat_interleave(n_best, dim=0),
        rules,
        sampler,
        penalty,
        **lengths,
        stepping=stepping,
    )
    tokens, scores = tokens.view(batch, n_best, tokens.shape[-1]), scores.view(batch, n_best)  # (B, n, L)
    scores, order = scores.sort(dim=1, descending=True, stable=True)
    return tokens.gather(1, order.unsqueeze(-1).expand_as(tokens)), scores


def row_search(
    model: Searchable,
    src: Tensor,
    rules: StepRules,
    pick: Callable[[Tensor], Tensor],
    penalty: LengthNormalizer,
    max_len_a: float,
    max_len_b: float,
    stepping: Stepping,
) -> tuple[Tensor, Tensor]:
    """One hypothesis per row, its next token chosen by `pick` (argmax: greedy search; a `Sampler`)
    -> (hypotheses (B, L), scores (B,) length-normalized).

    Rows that finish leave the decoder batch; with a static cache they stay in it (fixed shapes, their
    outputs unused) and `pick` sees the live rows only, as it would without (so sampling draws alike)."""
    config, batch = model.config, src.size(0)
    limits = LengthLimits.of(config, src, max_len_a, max_len_b)  # the one read before the loop
    longest = limits.longest
    hypotheses = src.new_full((batch, 1 + longest), config.pad_id)  # BOS, then the tokens
    hypotheses[:, 0] = config.bos_id
    log_prob_sums = torch.zeros(batch, device=src.device)
    step = 0
    if batch:
        src_padding_mask = model.padding_mask(src)  # (N, S) for the rows in the decoder batch
        memory = model.encode(src)  # projected once into the cross-attention caches
        cache = stepping.new_cache(model, batch, longest, 1, src.device)
        rows = torch.arange(batch, device=src.device)  # (N,) original row of each row still decoding
        decoded = rows  # the decoder batch: `rows`, or all B rows with a static cache
        last_tokens = hypotheses[:, 0]
        while True:
            at_max_length = limits.reached(decoded, step, always=stepping.static)  # (N,) or None
            history = hypotheses[decoded, : step + 1] if rules.needs_history else None
            log_probs = stepping(
                step, model, last_tokens, memory, src_padding_mask, cache, rules, at_max_length, history
            )  # (N, V), or (B, V) with a static cache
            if log_probs.shape[0] != rows.numel():
                log_probs = log_probs.index_select(0, rows)  # (N, V) the live rows of a static batch
            tokens = pick(log_probs)  # (N,)
            if rules.constraints is not None:
                rules.constraints.advance(tokens)
            log_prob_sums.index_add_(0, rows, log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1))
            hypotheses[rows, step + 1] = tokens
            step += 1
            running = tokens != config.eos_id  # (N,)
            n_live = int(running.sum())  # the one value read back per step
            if not n_live:
                break
            stepping.advance(cache)
            # (B,) with a static cache: finished rows feed their last token again, unused
            last_tokens = last_tokens.index_copy(0, rows, tokens) if stepping.static else tokens
            if n_live < rows.numel():  # finished rows leave (the batch and the caches), or are masked
                keep = (~running).byte().argsort(stable=True)[:n_live]  # (N',) in order
                rows = rows[keep]
                if not stepping.static:
                    decoded, last_tokens, src_padding_mask = rows, last_tokens[keep], src_padding_mask[keep]
                    cache.reorder(keep)
                if rules.constraints is not None:
                    rules.constraints.select(keep)
    tokens = hypotheses[:, 1 : 1 + step]  # (B, L)
    return tokens, log_prob_sums / penalty(tokens.ne(config.pad_id).sum(dim=1))
