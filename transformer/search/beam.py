"""Beam search over the decoder's KV cache (Section 6.1; GNMT's length penalty or len ** alpha), batched,
with every piece of bookkeeping on the device.

Each sentence keeps its K best finished hypotheses in fixed-size tensors (tokens (B, K, L), scores
(B, K)), merged with the step's newly ended ones by one sort; the stop test compares tensors. The loop
reads back one number per step, how many sentences are still searching, and sentences that are done
leave the batch (the work shrinks as decoding goes), so no result depends on the others in its batch;
with a static KV cache they stay, masked (`transformer.search.static_cache`: fixed shapes for a
compiled step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from transformer.search.static_cache import Stepping
from transformer.search.step import LengthLimits, LengthNormalizer, Searchable, StepRules

_NONE = 1 << 30  # `_Finished.unmet` of an empty slot


@dataclass
class _Finished:
    """The K best ended hypotheses of every sentence, best first: tokens (B, K, L) pad-filled and
    length-normalized scores (B, K), -inf where fewer than K have ended. Under constraints, `unmet`
    (B, K) counts the constraint tokens each misses (only a hypothesis cut at its maximum length misses
    any): fewer unmet ranks first, then the score."""

    tokens: Tensor
    scores: Tensor
    unmet: Tensor | None = None

    def add(self, sentences: Tensor, tokens: Tensor, scores: Tensor, unmet: Tensor | None = None) -> None:
        """Merge the step's candidates (n, K, L) / (n, K) (-inf: not ended) of `sentences` (n,).

        The stable sort puts earlier hypotheses before later ones of equal score, and a step's
        candidates in their rank order: the order in which they ended."""
        beam_size = self.scores.shape[1]
        merged_scores = torch.cat([self.scores[sentences], scores], dim=1)  # (n, 2K)
        best, order = merged_scores.sort(dim=1, descending=True, stable=True)
        if self.unmet is not None and unmet is not None:
            unmet = unmet.masked_fill(torch.isinf(scores), _NONE)  # (n, K) not ended: after every ended one
            merged_unmet = torch.cat([self.unmet[sentences], unmet], dim=1).gather(1, order)  # (n, 2K)
            merged_unmet, first = merged_unmet.sort(dim=1, stable=True)
            best, order = best.gather(1, first), order.gather(1, first)
            self.unmet[sentences] = merged_unmet[:, :beam_size]
        order = order[:, :beam_size]  # (n, K)
        merged_tokens = torch.cat([self.tokens[sentences], tokens], dim=1)  # (n, 2K, L)
        self.tokens[sentences] = merged_tokens.gather(1, order.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
        self.scores[sentences] = best[:, :beam_size]

    def n_best(self, n_best: int, pad_id: int) -> tuple[Tensor, Tensor]:
        """(B, n_best, L') hypotheses cut to the longest one, and their scores (B, n_best)."""
        tokens, scores = self.tokens[:, :n_best], self.scores[:, :n_best]
        length = int(tokens.ne(pad_id).sum(dim=-1).max()) if tokens.numel() else 0  # once, after the search
        return tokens[..., :length], scores


def beam_search_loop(
    model: Searchable,
    src: Tensor,
    rules: StepRules,
    beam_size: int,
    penalty: LengthNormalizer,
    max_len_a: float,
    max_len_b: float,
    n_best: int,
    stepping: Stepping | None = None,
) -> tuple[Tensor, Tensor]:
    """src (B, S) long -> (hypotheses (B, n_best, L) long, scores (B, n_best) float), best first.

    Each step ranks the 2K best extensions of each sentence: EOS ones among the first K end a
    hypothesis, the best K others live on (so EOS never crowds out live beams, as in fairseq). A
    sentence stops at its max length (EOS forced), or once K hypotheses have ended and its best live
    beam, normalized at the current length, does not beat the K-th of them (Hugging Face's default
    heuristic, its `early_stopping=False`; exact when the length penalty's alpha is 0). With a static
    cache (`stepping.static`) a sentence that is done stays in the batch and adds nothing more (the same
    results, fixed shapes). With required
    phrases (`rules.constraints`) the candidates and survivors are Dynamic Beam Allocation's
    (`ConstraintState.candidates` / `survivors`).
    """
    stepping = stepping or Stepping()
    config, device, batch = model.config, src.device, src.size(0)
    limits = LengthLimits.of(config, src, max_len_a, max_len_b)  # the one read before the loop
    lengths, longest = limits.per_sentence, limits.longest  # (B,), int
    constraints = (
        rules.constraints if rules.constraints is not None and rules.constraints.has_include else None
    )
    finished = _Finished(
        src.new_full((batch, beam_size, longest), config.pad_id),
        torch.full((batch, beam_size), -math.inf, device=device),
        None if constraints is None else torch.full((batch, beam_size), _NONE, device=device),
    )
    if not batch:
        return finished.n_best(n_best, config.pad_id)
    # (B, S), then (n, S) for the live sentences: the beams of a sentence share its memory row
    sentence_padding_mask = src_padding_mask = model.padding_mask(src)
    memory = model.encode(src)
    cache = stepping.new_cache(model, batch, longest, beam_size, device)
    # (B,) the sentences that stopped, with a static cache (they stay in the batch); None otherwise
    done = torch.zeros(batch, dtype=torch.bool, device=device) if stepping.static else None

    sentences = torch.arange(batch, device=device)  # (n,) original index of each live sentence
    beams, step = 1, 0  # one beam at the first step: all beams would be equal
    scores = torch.zeros(batch, 1, device=device)  # (n, beams) summed log-probabilities
    history = src.new_full((batch, 1), config.bos_id)  # (n * beams, 1 + t): BOS and the tokens so far
    last_tokens = history[:, 0]  # (n * beams,) its last column, contiguous (one stride for a compiled step)
    per_beam = min(2 * beam_size, config.tgt_vocab_size)  # tokens considered per beam
    while True:
        n = sentences.numel()
        at_max_length = limits.reached(sentences, step, always=stepping.static)  # (n,) or None
        if at_max_length is not None:
            at_max_length = at_max_length.repeat_interleave(beams)  # (n * beams,)
        log_probs = stepping(
            step, model, last_tokens, memory, src_padding_mask, cache, rules, at_max_length, history
        )  # (n * beams, V)

        # 1. the 2K best candidates of each sentence: their scores, tokens and parent beams
        if constraints is None:
            n_candidates = min(2 * beam_size, beams * per_beam)
            cand_scores, cand_tokens, cand_parents = _candidates(log_probs, scores, per_beam, n_candidates)
        else:  # every candidate: the top ones and the constraints' next tokens
            cand_scores, cand_tokens, cand_parents = constraints.candidates(log_probs, scores, per_beam)
            n_candidates = cand_scores.shape[1]
        cand_rows = torch.arange(n, device=device).unsqueeze(1) * beams + cand_parents  # (n, 2K) in history

        # 2. EOS among the K best candidates ends a hypothesis (-inf ones are dead beams' leftovers)
        normalizer = penalty(step + 1)  # the length of a hypothesis that ends here, EOS included
        is_eos = cand_tokens == config.eos_id  # (n, 2K)
        ended = is_eos[:, :beam_size] & torch.isfinite(cand_scores[:, :beam_size])  # (n, K)
        if done is not None:
            ended &= ~done.unsqueeze(1)  # a done sentence's beams run on, ending nothing
        ended_tokens = _ended_tokens(history, cand_rows[:, :beam_size], longest, config.pad_id, config.eos_id)
        ended_scores = (cand_scores[:, :beam_size] / normalizer).masked_fill(~ended, -math.inf)
        unmet = (
            None if constraints is None else constraints.unmet_tokens(cand_rows[:, :beam_size].reshape(-1))
        )
        finished.add(sentences, ended_tokens, ended_scores, None if unmet is None else unmet.view(n, -1))

        # 3. the K best non-EOS candidates live on (under constraints: shared among the banks)
        beams = min(beam_size, n_candidates)
        if constraints is None:
            pick, new_tokens, scores = _survivors(cand_scores, cand_tokens, is_eos, beams)  # each (n, K)
        else:
            pick, new_tokens, scores = constraints.survivors(
                cand_scores, cand_tokens, cand_rows, is_eos, beams
            )

        # 4. a sentence is done at its max length, or once K hypotheses ended and its best live beam,
        #    normalized at the current length, scores below the K-th of them (exact for
        #    alpha 0; with one beam it stops exactly where greedy search stops)
        kth_best = finished.scores[sentences, -1]  # (n,) -inf until K have ended
        stops = (lengths[sentences] <= step + 1) | (kth_best >= scores[:, 0] / normalizer)  # (n,)
        if done is not None:
            done = stops = done | stops
        n_live = n - int(stops.sum())  # the one value read back per step
        if not n_live:
            break
        live = None
        if n_live < n and done is None:
            live = stops.byte().argsort(stable=True)[:n_live]  # (n',) in order
        parents = cand_parents.gather(1, pick)  # (n, K)
        rows = cand_rows.gather(1, pick)  # (n, K) parent rows of the new beams
        if live is not None:
            parents, rows, new_tokens, scores = parents[live], rows[live], new_tokens[live], scores[live]
            sentences = sentences[live]
            src_padding_mask = sentence_padding_mask[sentences]  # (n', S)
        last_tokens = new_tokens.view(-1)  # (n' * K,)
        history = torch.cat([history[rows.view(-1)], last_tokens.unsqueeze(1)], dim=1)  # (n' * K, 2 + t)
        if rules.constraints is not None:  # each new beam takes its parent's progress, then its token's
            rules.constraints.select(rows.view(-1))
            rules.constraints.advance(last_tokens)
        # a beam's parent is a beam of the same sentence: the caches (one row per sentence) only lose
        # the sentences that are done, and each new beam points at its parent's keys
        cache.select_beams(parents, live)
        step += 1
        stepping.advance(cache)
    return finished.n_best(n_best, config.pad_id)


def _ended_tokens(history: Tensor, rows: Tensor, longest: int, pad_id: int, eos_id: int) -> Tensor:
    """The hypotheses that candidates `rows` (n, K) would end: their parent's tokens (history without
    BOS) and EOS, padded to (n, K, longest)."""
    n, k = rows.shape
    tokens = history[rows.reshape(-1), 1:]  # (n * K, t)
    step = tokens.shape[1]
    out = tokens.new_full((n * k, longest), pad_id)
    out[:, :step] = tokens
    out[:, step] = eos_id
    return out.view(n, k, longest)


def _candidates(
    log_probs: Tensor, scores: Tensor, per_beam: int, n_candidates: int
) -> tuple[Tensor, Tensor, Tensor]:
    """log_probs (n * beams, V) of the next token, scores (n, beams) so far -> the `n_candidates` best
    extensions of each sentence: (scores, tokens, index of the beam each extends), each (n, 2K).

    Each beam's top 2K tokens suffice for the top 2K overall; the stable sort keeps a beam's own order
    on ties, so one beam reproduces greedy search's argmax exactly.
    """
    n, beams = scores.shape
    top_log_probs, top_tokens = log_probs.topk(per_beam, dim=-1)  # (n * beams, 2K)
    totals = scores.unsqueeze(-1) + top_log_probs.view(n, beams, per_beam)  # (n, beams, 2K)
    cand_scores, order = totals.view(n, beams * per_beam).sort(dim=-1, descending=True, stable=True)
    cand_scores, order = cand_scores[:, :n_candidates], order[:, :n_candidates]  # (n, 2K)
    cand_tokens = top_tokens.view(n, beams * per_beam).gather(1, order)  # (n, 2K)
    return cand_scores, cand_tokens, order // per_beam


def _survivors(
    cand_scores: Tensor, cand_tokens: Tensor, is_eos: Tensor, beams: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The `beams` best non-EOS candidates of each sentence: (their index among the candidates, their
    tokens, their scores). Should EOS ones have to fill the slots (tiny vocabularies), they stay as dead
    beams scored -inf."""
    n_candidates = cand_scores.size(1)
    rank = torch.arange(n_candidates, device=cand_scores.device) + is_eos * n_candidates  # EOS ranked last
    pick = rank.argsort(dim=-1, stable=True)[:, :beams]  # (n, K)
    new_tokens = cand_tokens.gather(1, pick)  # (n, K)
    return pick, new_tokens, cand_scores.gather(1, pick).masked_fill(is_eos.gather(1, pick), -math.inf)
