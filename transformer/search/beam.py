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

from transformer.search.constraints import ConstraintState
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
    constraints = (
        rules.constraints if rules.constraints is not None and rules.constraints.has_include else None
    )
    finished = _Finished(
        src.new_full((batch, beam_size, limits.longest), config.pad_id),
        torch.full((batch, beam_size), -math.inf, device=device),
        None if constraints is None else torch.full((batch, beam_size), _NONE, device=device),
    )
    if batch:
        search = _BeamSearch(model, src, rules, beam_size, penalty, limits, stepping, constraints, finished)
        while search.step():
            pass
    return finished.n_best(n_best, config.pad_id)


@dataclass
class _Candidates:
    """A step's best extensions of each live sentence (n, C), best first (C = 2K without constraints)."""

    scores: Tensor  # summed log-probabilities
    tokens: Tensor
    parents: Tensor  # the beam of its sentence each extends
    rows: Tensor  # that beam's row in the history (n * beams rows)
    is_eos: Tensor


class _BeamSearch:
    """One beam search: its fixed parts (the model's memory, the cache, the limits) and the live beams.
    `step` runs one step of `beam_search_loop`: rank the candidates, end hypotheses, keep the survivors,
    stop the sentences that are done, advance the rest."""

    def __init__(
        self,
        model: Searchable,
        src: Tensor,
        rules: StepRules,
        beam_size: int,
        penalty: LengthNormalizer,
        limits: LengthLimits,
        stepping: Stepping,
        constraints: ConstraintState | None,
        finished: _Finished,
    ) -> None:
        config, device, batch = model.config, src.device, src.size(0)
        self.model, self.rules, self.beam_size, self.penalty = model, rules, beam_size, penalty
        self.limits, self.stepping, self.constraints, self.finished = limits, stepping, constraints, finished
        self.pad_id, self.eos_id, self.longest = config.pad_id, config.eos_id, limits.longest
        # (B, S), then (n, S) for the live sentences: the beams of a sentence share its memory row
        self.sentence_padding_mask = self.src_padding_mask = model.padding_mask(src)
        self.memory = model.encode(src)
        self.cache = stepping.new_cache(model, batch, self.longest, beam_size, device)
        # (B,) the sentences that stopped, with a static cache (they stay in the batch); None otherwise
        self.done = torch.zeros(batch, dtype=torch.bool, device=device) if stepping.static else None
        self.sentences = torch.arange(batch, device=device)  # (n,) original index of each live sentence
        self.beams, self.step_index = 1, 0  # one beam at the first step: all beams would be equal
        self.scores = torch.zeros(batch, 1, device=device)  # (n, beams) summed log-probabilities
        self.history = src.new_full((batch, 1), config.bos_id)  # (n * beams, 1 + t): BOS and tokens so far
        self.last_tokens = self.history[:, 0]  # (n * beams,) its last column, contiguous (one stride)
        self.per_beam = min(2 * beam_size, config.tgt_vocab_size)  # tokens considered per beam

    def step(self) -> bool:
        """One step; False once every sentence is done."""
        candidates = self._rank(self._log_probs())
        normalizer = self.penalty(self.step_index + 1)  # the length of a hypothesis that ends here, EOS too
        self._end_hypotheses(candidates, normalizer)
        pick, new_tokens, scores = self._survive(candidates)
        stops = self._stops(scores, normalizer)
        n_live = stops.numel() - int(stops.sum())  # the one value read back per step
        if n_live:
            self._advance(candidates, pick, new_tokens, scores, stops, n_live)
        return bool(n_live)

    def _log_probs(self) -> Tensor:
        """(n * beams, V): the next token's log-probabilities of every live beam."""
        at_max_length = self.limits.reached(self.sentences, self.step_index, always=self.stepping.static)
        if at_max_length is not None:
            at_max_length = at_max_length.repeat_interleave(self.beams)  # (n * beams,)
        return self.stepping(
            self.step_index,
            self.model,
            self.last_tokens,
            self.memory,
            self.src_padding_mask,
            self.cache,
            self.rules,
            at_max_length,
            self.history,
        )

    def _rank(self, log_probs: Tensor) -> _Candidates:
        """1. the 2K best candidates of each sentence (under constraints: the top ones and the
        constraints' next tokens)."""
        n = self.sentences.numel()
        if self.constraints is None:
            n_candidates = min(2 * self.beam_size, self.beams * self.per_beam)
            scores, tokens, parents = _candidates(log_probs, self.scores, self.per_beam, n_candidates)
        else:
            scores, tokens, parents = self.constraints.candidates(log_probs, self.scores, self.per_beam)
        rows = torch.arange(n, device=scores.device).unsqueeze(1) * self.beams + parents  # (n, C)
        return _Candidates(scores, tokens, parents, rows, tokens == self.eos_id)

    def _end_hypotheses(self, candidates: _Candidates, normalizer: Tensor | float) -> None:
        """2. EOS among the K best candidates ends a hypothesis (-inf ones are dead beams' leftovers)."""
        k, n = self.beam_size, self.sentences.numel()
        ended = candidates.is_eos[:, :k] & torch.isfinite(candidates.scores[:, :k])  # (n, K)
        if self.done is not None:
            ended &= ~self.done.unsqueeze(1)  # a done sentence's beams run on, ending nothing
        rows = candidates.rows[:, :k]
        ended_tokens = _ended_tokens(self.history, rows, self.longest, self.pad_id, self.eos_id)
        ended_scores = (candidates.scores[:, :k] / normalizer).masked_fill(~ended, -math.inf)
        unmet = None if self.constraints is None else self.constraints.unmet_tokens(rows.reshape(-1))
        self.finished.add(
            self.sentences, ended_tokens, ended_scores, None if unmet is None else unmet.view(n, -1)
        )

    def _survive(self, candidates: _Candidates) -> tuple[Tensor, Tensor, Tensor]:
        """3. the K best non-EOS candidates live on (under constraints: shared among the banks): their
        index among the candidates, tokens and scores, each (n, K)."""
        self.beams = min(self.beam_size, candidates.scores.shape[1])
        if self.constraints is None:
            return _survivors(candidates.scores, candidates.tokens, candidates.is_eos, self.beams)
        return self.constraints.survivors(
            candidates.scores, candidates.tokens, candidates.rows, candidates.is_eos, self.beams
        )

    def _stops(self, scores: Tensor, normalizer: Tensor | float) -> Tensor:
        """4. (n,) bool: a sentence is done at its max length, or once K hypotheses ended and its best
        live beam, normalized at the current length, scores below the K-th of them (exact for alpha 0;
        with one beam it stops exactly where greedy search stops)."""
        kth_best = self.finished.scores[self.sentences, -1]  # (n,) -inf until K have ended
        at_limit = self.limits.per_sentence[self.sentences] <= self.step_index + 1
        stops = at_limit | (kth_best >= scores[:, 0] / normalizer)
        if self.done is not None:
            self.done = stops = self.done | stops
        return stops

    def _advance(
        self,
        candidates: _Candidates,
        pick: Tensor,
        new_tokens: Tensor,
        scores: Tensor,
        stops: Tensor,
        n_live: int,
    ) -> None:
        """5. the survivors become the beams of the next step; the sentences that are done leave the batch
        (with a static cache they stay)."""
        live = None
        if n_live < stops.numel() and self.done is None:
            live = stops.byte().argsort(stable=True)[:n_live]  # (n',) in order
        parents = candidates.parents.gather(1, pick)  # (n, K)
        rows = candidates.rows.gather(1, pick)  # (n, K) parent rows of the new beams
        if live is not None:
            parents, rows, new_tokens, scores = parents[live], rows[live], new_tokens[live], scores[live]
            self.sentences = self.sentences[live]
            self.src_padding_mask = self.sentence_padding_mask[self.sentences]  # (n', S)
        self.scores = scores
        self.last_tokens = new_tokens.view(-1)  # (n' * K,)
        self.history = torch.cat([self.history[rows.view(-1)], self.last_tokens.unsqueeze(1)], dim=1)
        if self.rules.constraints is not None:  # each new beam takes its parent's progress, then its token's
            self.rules.constraints.select(rows.view(-1))
            self.rules.constraints.advance(self.last_tokens)
        # a beam's parent is a beam of the same sentence: the caches (one row per sentence) only lose
        # the sentences that are done, and each new beam points at its parent's keys
        self.cache.select_beams(parents, live)
        self.step_index += 1
        self.stepping.advance(self.cache)


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
