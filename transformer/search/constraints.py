"""Constrained decoding: a target prefix forced at the first steps, phrases that must appear (hard lexical
constraints by Dynamic Beam Allocation, Post & Vilar 2018, in the vectorized form of Hu et al. 2019) and
phrases that must not (negative constraints), per sentence, in target token ids.

`ConstraintState` holds every hypothesis' progress on the device: which tokens of each required phrase
it has just produced, which phrases it has met. The one step (`transformer.search.step.next_log_probs`)
asks it to restrict the next token (`restrict`); beam search asks it for the extra candidates and the
bank allocation of the survivors (`candidates`, `survivors`). Nothing here reads the device back: the
sizes it needs (longest prefix, most constraint tokens) are known on the host from the requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ConstraintState", "TargetRequest", "unsatisfiable"]


@dataclass(frozen=True)
class TargetRequest:
    """What one sentence asks of its output, in target token ids (no BOS / EOS): the tokens it starts
    with (`prefix`), phrases that must appear in any order (`include`), phrases that must not (`avoid`)."""

    prefix: tuple[int, ...] = ()
    include: tuple[tuple[int, ...], ...] = ()
    avoid: tuple[tuple[int, ...], ...] = ()

    @property
    def needed(self) -> int:
        """Tokens an output needs at least: the prefix, every required phrase, and EOS."""
        return len(self.prefix) + sum(len(phrase) for phrase in self.include) + 1

    def __bool__(self) -> bool:
        return bool(self.prefix or self.include or self.avoid)


def unsatisfiable(requests: Sequence[TargetRequest], limits: Sequence[int]) -> list[int]:
    """Indices of the sentences whose prefix and required phrases cannot fit in their length limit
    (tokens, EOS included): their outputs are cut at the limit, with some phrase missing."""
    return [
        i for i, (request, limit) in enumerate(zip(requests, limits, strict=True)) if request.needed > limit
    ]


def _row(tokens: Sequence[int], width: int, right: bool) -> list[int]:
    """A token list padded with -1 (never a token) to `width`, left- or right-aligned."""
    fill = [-1] * (width - len(tokens))
    return fill + list(tokens) if right else list(tokens) + fill


def _table(rows: Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """Token lists -> (len(rows), at least 1) long on `device`, -1-filled: one host-to-device copy."""
    width = max(1, max((len(row) for row in rows), default=0))
    return torch.tensor([_row(row, width, False) for row in rows], dtype=torch.long, device=device)


def _phrases(lists: Sequence[Sequence[Sequence[int]]], device: torch.device, right: bool = False) -> Tensor:
    """Per sentence a list of phrases -> (B, C, L) long, -1-filled (C, L: the most phrases, the longest;
    L at least 1), phrases left- or right-aligned."""
    count = max((len(phrases) for phrases in lists), default=0)
    width = max(1, max((len(p) for phrases in lists for p in phrases), default=0))
    table = [
        [_row(p, width, right) for p in phrases] + [[-1] * width] * (count - len(phrases))
        for phrases in lists
    ]
    return torch.tensor(table, dtype=torch.long, device=device).view(len(lists), count, width)


class ConstraintState:
    """The requests of a batch as device tables, and the constraint progress of each hypothesis.

    Rows are the search's hypotheses (its decoder batch); `sentence` (N,) says whose request each row
    follows. `progress` (N, C) counts the tokens of required phrase c just produced in a row (a phrase
    that breaks off drops back to 0, or to 1 when the token starts it again: its progress is undone);
    `met` (N, C) marks the phrases completed. A row may produce EOS only once every phrase is met (its
    maximum length still forces EOS: `unsatisfiable` reports those sentences beforehand).

    `word_continuations` (the target vocabulary's pieces that continue a word, e.g. BPE pieces without
    the word-start mark) make a required phrase end at a word end: the token after a completed phrase may
    not be one of them (`just_met` (N,) marks the rows whose last token completed one). Without them, a
    phrase is met by its pieces even where they start a longer word ("dog" in "dogs").
    """

    def __init__(
        self, requests: Sequence[TargetRequest], device: torch.device, word_continuations: Sequence[int] = ()
    ) -> None:
        self.longest_prefix = max((len(r.prefix) for r in requests), default=0)
        self.prefix = _table([r.prefix for r in requests], device)  # (B, P)
        self.phrases = _phrases([r.include for r in requests], device)  # (B, C, L)
        self.phrase_lengths = self.phrases.ge(0).sum(dim=-1)  # (B, C), 0: no phrase
        avoid = _phrases([r.avoid for r in requests], device, right=True)  # (B, A, La) right-aligned
        self.avoid_last, self.avoid_context = avoid[..., -1], avoid[..., :-1]  # (B, A), (B, A, La - 1)
        self.has_include = self.phrases.shape[1] > 0
        self.has_avoid = avoid.shape[1] > 0
        # the banks of Dynamic Beam Allocation: 0 .. the most constraint tokens of a sentence
        self.n_banks = 1 + max((sum(len(p) for p in r.include) for r in requests), default=0)
        self.sentence = torch.arange(len(requests), device=device)  # (N,)
        self.progress = torch.zeros(self.phrases.shape[:2], dtype=torch.long, device=device)  # (N, C)
        self.met = torch.zeros(self.phrases.shape[:2], dtype=torch.bool, device=device)  # (N, C)
        self.continuations = (
            torch.tensor(sorted(set(word_continuations)), dtype=torch.long, device=device)
            if word_continuations and self.has_include
            else None
        )
        self.just_met = torch.zeros(len(requests), dtype=torch.bool, device=device)  # (N,)

    def repeat(self, times: int) -> ConstraintState:
        """Each sentence's rows `times` times in a row (sampling's n independent samples)."""
        self.sentence = self.sentence.repeat_interleave(times)
        self.progress = self.progress.repeat_interleave(times, dim=0)
        self.met = self.met.repeat_interleave(times, dim=0)
        self.just_met = self.just_met.repeat_interleave(times)
        return self

    # -- the step's rules ------------------------------------------------------------------------------

    def restrict(self, log_probs: Tensor, step: int, history: Tensor | None, eos_id: int) -> None:
        """Write the constraints into the step's log_probs (N, V) in place: the prefix token forced
        while a row's prefix lasts (keeping its real log-probability), avoided phrases' last tokens
        banned where the rest was just produced, EOS banned while a required phrase is unmet, a word's
        continuation banned right after a completed phrase (with `word_continuations`)."""
        forced = None
        if step < self.longest_prefix:
            forced = self.prefix[self.sentence, step].unsqueeze(1)  # (N, 1), -1: the prefix is over
            forced_log_probs = log_probs.gather(1, forced.clamp(min=0))  # before any ban below
        if self.has_avoid and history is not None:
            log_probs.masked_fill_(self._avoided(history, log_probs.shape[-1]), -math.inf)
        if self.has_include:
            unmet = (~self.met & self.phrase_lengths[self.sentence].gt(0)).any(dim=1)  # (N,)
            log_probs[:, eos_id] = log_probs[:, eos_id].masked_fill(unmet, -math.inf)
        if self.continuations is not None:  # (N, k): -inf where the row just met a phrase
            ended = torch.zeros_like(log_probs[:, : self.continuations.numel()]).masked_fill_(
                self.just_met.unsqueeze(1), -math.inf
            )
            log_probs.index_add_(1, self.continuations, ended)
        if forced is not None:
            forcing = forced >= 0  # (N, 1)
            vocab = torch.arange(log_probs.shape[-1], device=log_probs.device)
            log_probs.masked_fill_(forcing & (vocab != forced), -math.inf)  # (N, V): one pass
            index = forced.clamp(min=0)
            log_probs.scatter_(1, index, torch.where(forcing, forced_log_probs, log_probs.gather(1, index)))

    def _avoided(self, history: Tensor, vocab_size: int) -> Tensor:
        """history (N, t) (BOS and the tokens so far) -> (N, V) bool: the last token of each avoided
        phrase whose other tokens are the row's last ones (a one-token phrase: always)."""
        context = self.avoid_context[self.sentence]  # (N, A, W) right-aligned, -1 before a phrase's start
        width = context.shape[-1]
        tail = history[:, -width:] if width else history[:, :0]  # (N, <= W)
        if tail.shape[1] < width:  # a history shorter than the longest context: -2 matches no token
            tail = torch.cat([tail.new_full((tail.shape[0], width - tail.shape[1]), -2), tail], dim=1)
        matches = ((context == tail.unsqueeze(1)) | context.lt(0)).all(dim=-1)  # (N, A)
        last = self.avoid_last[self.sentence]  # (N, A), -1: no phrase
        matches &= last >= 0
        # every write is True, so repeated indices cannot disagree; column V takes the non-matches
        banned = torch.zeros(history.shape[0], vocab_size + 1, dtype=torch.bool, device=history.device)
        return banned.scatter_(1, torch.where(matches, last, vocab_size), True)[:, :vocab_size]

    # -- following the hypotheses ----------------------------------------------------------------------

    def select(self, rows: Tensor) -> None:
        """The rows (n',) that go on (the parents of the new beams, or the rows still decoding)."""
        self.sentence, self.progress, self.met = self.sentence[rows], self.progress[rows], self.met[rows]
        self.just_met = self.just_met[rows]

    def advance(self, tokens: Tensor) -> None:
        """Every row (N,) produced `tokens` (N,): its progress moves on."""
        if self.has_include:
            before = self.met
            self.progress, self.met = self._advanced(self.sentence, self.progress, self.met, tokens)
            self.just_met = (self.met & ~before).any(dim=1)

    def _advanced(
        self, sentence: Tensor, progress: Tensor, met: Tensor, tokens: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(progress, met) (M, C) of rows of `sentence` (M,) after `tokens` (M,)."""
        phrases, lengths = self.phrases[sentence], self.phrase_lengths[sentence]  # (M, C, L), (M, C)
        open_ = ~met & lengths.gt(0)
        expected = phrases.gather(2, progress.unsqueeze(-1)).squeeze(-1)  # (M, C) the next token of each
        token = tokens.unsqueeze(1)  # (M, 1)
        restart = (phrases[..., 0] == token).long()  # a broken-off phrase may start again at this token
        progress = torch.where(open_ & (expected == token), progress + 1, restart * open_)
        met = met | (open_ & (progress >= lengths))
        return progress.masked_fill(met, 0), met

    def _banks(self, sentence: Tensor, progress: Tensor, met: Tensor) -> Tensor:
        """(M,) constraint tokens met: the met phrases' lengths plus the furthest progress on an open one."""
        lengths = self.phrase_lengths[sentence]  # (M, C)
        return (lengths * met).sum(dim=1) + progress.max(dim=1).values

    # -- Dynamic Beam Allocation -----------------------------------------------------------------------

    def candidates(self, log_probs: Tensor, scores: Tensor, per_beam: int) -> tuple[Tensor, Tensor, Tensor]:
        """As beam search's `_candidates`, with each beam's next token of every open phrase added to its
        top `per_beam` tokens (Post & Vilar's candidate sets: the best tokens, the constraints' next
        tokens; the best continuation is the first of the top ones) -> (scores, tokens, parent beams),
        each (n, M), best first (-inf: a duplicate or no phrase)."""
        n, beams = scores.shape
        top_log_probs, top_tokens = log_probs.topk(per_beam, dim=-1)  # (N, k)
        phrases = self.phrases[self.sentence]  # (N, C, L)
        lengths = self.phrase_lengths[self.sentence]  # (N, C)
        nexts = phrases.gather(2, self.progress.unsqueeze(-1)).squeeze(-1).clamp(min=0)  # (N, C)
        wanted = ~self.met & lengths.gt(0)
        wanted &= ~(nexts.unsqueeze(-1) == top_tokens.unsqueeze(1)).any(dim=-1)  # not among the top ones
        earlier = torch.ones(nexts.shape[1], nexts.shape[1], dtype=torch.bool, device=nexts.device).tril(-1)
        twice = ((nexts.unsqueeze(2) == nexts.unsqueeze(1)) & wanted.unsqueeze(1) & earlier).any(dim=-1)
        extra = log_probs.gather(1, nexts).masked_fill(~wanted | twice, -math.inf)  # (N, C)
        width = per_beam + nexts.shape[1]
        tokens = torch.cat([top_tokens, nexts], dim=1).view(n, beams * width)  # (n, beams * W)
        totals = (scores.view(-1, 1) + torch.cat([top_log_probs, extra], dim=1)).view(n, beams * width)
        cand_scores, order = totals.sort(dim=-1, descending=True, stable=True)
        return cand_scores, tokens.gather(1, order), order // width

    def survivors(
        self, cand_scores: Tensor, cand_tokens: Tensor, cand_rows: Tensor, is_eos: Tensor, beams: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The `beams` survivors of each sentence among its candidates (n, M), the beam divided among
        banks (constraint tokens met): the best of every bank first (fullest bank first), then the
        second best of each, and so on (Hu et al.'s round robin) -> (their index among the candidates,
        their tokens, their scores), best score first; EOS and -inf candidates only fill empty slots
        (dead beams, scored -inf)."""
        n, m = cand_scores.shape
        rows, tokens = cand_rows.reshape(-1), cand_tokens.reshape(-1)  # (n * M,)
        sentence = self.sentence[rows]
        progress, met = self._advanced(sentence, self.progress[rows], self.met[rows], tokens)
        bank = self._banks(sentence, progress, met).view(n, m)  # (n, M)
        usable = ~is_eos & torch.isfinite(cand_scores)
        members = torch.nn.functional.one_hot(bank, self.n_banks).bool() & usable.unsqueeze(-1)  # (n, M, b)
        rank = (members.long().cumsum(dim=1) - 1).gather(2, bank.unsqueeze(-1)).squeeze(-1)  # (n, M)
        key = rank * self.n_banks + (self.n_banks - 1 - bank)
        last = self.n_banks * m + torch.arange(m, device=key.device)  # after every usable one, in order
        pick = torch.where(usable, key, last).argsort(dim=1, stable=True)[:, :beams]  # (n, K)
        picked = cand_scores.gather(1, pick).masked_fill(~usable.gather(1, pick), -math.inf)
        picked, order = picked.sort(dim=1, descending=True, stable=True)
        pick = pick.gather(1, order)
        return pick, cand_tokens.gather(1, pick), picked

    def unmet_tokens(self, rows: Tensor) -> Tensor:
        """(M,) constraint tokens rows `rows` still miss (0: every phrase met), for ranking the ended."""
        return (self.phrase_lengths[self.sentence[rows]] * ~self.met[rows]).sum(dim=1)
