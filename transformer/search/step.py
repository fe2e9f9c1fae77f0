"""The one decoding step every search shares: a new position through the cached decoder(s), the
log-probabilities of the next token, and the rules that constrain it (special tokens, length limits,
n-gram blocking). Plus the choice of the next token in sampling (temperature, top-k, nucleus).

Nothing here reads the device back into Python: a step is a fixed sequence of tensor operations, so
a search that calls it once per step syncs only where it decides itself (`transformer.search.decoding`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from transformer.config import TransformerConfig
from transformer.search.constraints import ConstraintState
from transformer.search.ensemble import Ensemble


class Searchable(Protocol):
    """What a search needs of a model: `Seq2SeqTransformer`, or an `Ensemble` of them."""

    config: TransformerConfig
    training: bool

    def padding_mask(self, tokens: Tensor) -> Tensor: ...
    def encode(self, src: Tensor) -> object: ...
    def new_cache(self) -> object: ...
    def decode(self, tgt_in: Tensor, memory: object, src_padding_mask: Tensor, cache: object) -> Tensor: ...
    def train(self, mode: bool = True) -> nn.Module: ...


@contextmanager
def eval_mode(model: Searchable) -> Iterator[None]:
    """Decode without dropout and gradients, then restore the model's training flag."""
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class LengthLimits:
    """Per sentence (B,) long: at most floor(a * src_len + b) tokens, EOS included (src_len = non-pad),
    capped so that BOS plus every token fed back fits in the model's max_len positions; and the
    shortest and longest of them (read back once, before the search)."""

    per_sentence: Tensor
    shortest: int
    longest: int

    @classmethod
    def of(cls, config: TransformerConfig, src: Tensor, max_len_a: float, max_len_b: float) -> LengthLimits:
        src_lengths = src.ne(config.pad_id).sum(dim=1)  # (B,)
        limit = (src_lengths.double() * max_len_a + max_len_b).floor().long()  # float64: 1.2 * 10 stays 12
        limit = limit.clamp(min=1, max=config.max_len)
        shortest, longest = torch.stack([limit.min(), limit.max()]).tolist() if src.size(0) else (0, 0)
        return cls(limit, shortest, longest)

    def reached(self, rows: Tensor, step: int, always: bool = False) -> Tensor | None:
        """(N,) bool: rows `rows` (indices into the batch) whose next token is their last; None while no
        sentence can be there yet (no pass over the vocabulary needed), unless `always` (a compiled
        step's inputs keep their kind from step to step)."""
        return self.per_sentence[rows] == step + 1 if always or step + 1 >= self.shortest else None


# what a finished hypothesis' summed log-probability is divided by (`DecodingSettings.length_normalization`)
LENGTH_NORMALIZATIONS = ("gnmt", "power")


@dataclass(frozen=True)
class LengthNormalizer:
    """The length penalty of every search's scores, len counting a hypothesis' tokens with EOS (not BOS, the
    decoder's start): "gnmt" divides by ((5 + len) / 6) ** alpha (Wu et al., 2016); "power" by
    len ** alpha, as transformers' `generate` (its generated length: the new tokens with EOS), fairseq
    and Marian do. alpha 0: both divide by 1."""

    alpha: float
    form: str = "gnmt"

    def __call__(self, length: Tensor | int) -> Tensor | float:
        """The divisor for hypotheses of `length` tokens: (N,) float32 for a tensor (computed in float64),
        else a Python float (which a float32 tensor divides by in float32, as transformers' does)."""
        if isinstance(length, Tensor):
            base = length.double() if self.form == "power" else (5.0 + length.double()) / 6.0
            return base.pow(self.alpha).float()
        return float(length if self.form == "power" else (5.0 + length) / 6.0) ** self.alpha


@dataclass(frozen=True)
class StepRules:
    """What every step of a search forbids or forces, the same for greedy, beam and sampling.

    pad and BOS are never emitted (they would break the output layout); EOS is banned before
    `min_len` tokens (fairseq's --min-len) and forced at a sentence's maximum length; with
    `no_repeat_ngram_size` n > 0 no n-gram occurs twice in a hypothesis (fairseq's meaning: the
    n-grams of BOS + the tokens so far); `temperature` divides the logits before the softmax;
    `constraints` (a search's own, following its hypotheses) forces prefixes, bans avoided phrases and
    EOS before the required phrases are met (`transformer.search.constraints`).
    """

    pad_id: int
    bos_id: int
    eos_id: int
    min_len: int = 0
    no_repeat_ngram_size: int = 0
    temperature: float = 1.0
    constraints: ConstraintState | None = field(default=None, compare=False)

    @property
    def needs_history(self) -> bool:
        """Whether the step reads the hypotheses' tokens so far (n-gram blocking, avoided phrases)."""
        return bool(self.no_repeat_ngram_size) or (
            self.constraints is not None and self.constraints.has_avoid
        )


def next_log_probs(
    model: Searchable,
    last_tokens: Tensor,
    memory: object,
    src_padding_mask: Tensor,
    cache: object,
    rules: StepRules,
    step: int | Tensor,
    at_max_length: Tensor | None,
    history: Tensor | None = None,
) -> Tensor:
    """The shared search step: last_tokens (N,) -> log-probabilities of the next token (N, V), float32.

    `step` counts the tokens already generated: an int, or a 0-dim long device tensor (the static
    searches', whose step is one compiled graph whatever the step number); `at_max_length` (N,) bool
    rows may only produce EOS (keeping its real log-probability), None when no row is at its maximum
    length; `history` (N, t) holds BOS and the tokens so far, needed only for n-gram blocking. Banned
    tokens get -inf; the rest keep their log-probabilities (no renormalization, as in fairseq), so
    scores are the model's own. The rules are written in place into the fresh log-softmax output:
    column writes, and at most one pass over (N, V) per rule that can touch every token.
    """
    log_probs = _log_softmax(model, last_tokens, memory, src_padding_mask, cache, rules.temperature)
    eos = log_probs[:, rules.eos_id].clone()  # (N,) EOS's real log-probability, for the forced rows
    log_probs[:, rules.pad_id] = -math.inf  # never emitted: they would break the output layout
    log_probs[:, rules.bos_id] = -math.inf
    if isinstance(step, Tensor):  # decided on the device: the graph does not depend on the step number
        if rules.min_len:
            log_probs[:, rules.eos_id] = log_probs[:, rules.eos_id].masked_fill(
                step < rules.min_len, -math.inf
            )
    elif step < rules.min_len:
        log_probs[:, rules.eos_id] = -math.inf
    if rules.no_repeat_ngram_size and history is not None:
        log_probs.masked_fill_(
            repeated_ngram_ends(history, rules.no_repeat_ngram_size, log_probs.shape[-1]), -math.inf
        )
    if rules.constraints is not None:  # before the maximum length, which forces EOS whatever is unmet
        assert isinstance(step, int), "constraints run over the dynamic cache only (search() checks)"
        rules.constraints.restrict(log_probs, step, history, rules.eos_id)
    if at_max_length is not None:
        log_probs.masked_fill_(at_max_length.unsqueeze(1), -math.inf)
        log_probs[:, rules.eos_id] = torch.where(at_max_length, eos, log_probs[:, rules.eos_id])
    return log_probs


def _log_softmax(
    model: Searchable,
    last_tokens: Tensor,
    memory: object,
    src_padding_mask: Tensor,
    cache: object,
    temperature: float,
) -> Tensor:
    """(N, V) float32 log-probabilities of the next token at `temperature`, a new tensor (the caller writes
    into it). An ensemble mixes its models' distributions itself, each at the temperature."""
    if isinstance(model, Ensemble):
        return model.decode(last_tokens.unsqueeze(1), memory, src_padding_mask, cache, temperature)[:, -1]
    logits = model.decode(last_tokens.unsqueeze(1), memory, src_padding_mask, cache)[:, -1]  # (N, V)
    if temperature != 1.0:
        logits = logits.float() / temperature
    return logits.float().log_softmax(dim=-1)


def repeated_ngram_ends(history: Tensor, n: int, vocab_size: int) -> Tensor:
    """history (N, t) -> (N, V) bool: the tokens that would complete an n-gram already in the row.

    An n-gram of the history whose first n - 1 tokens equal the history's last n - 1 tokens bans its
    last token; all on the device (windows compared at once), so no per-row Python loop.
    """
    rows, length = history.shape
    banned = torch.zeros(rows, vocab_size, device=history.device)  # (N, V)
    if length < n:
        return banned.bool()
    windows = history.unfold(1, n, 1)  # (N, W, n), W = t - n + 1
    suffix = history[:, length - n + 1 :].unsqueeze(1)  # (N, 1, n - 1)
    matches = (windows[..., :-1] == suffix).all(dim=-1)  # (N, W); n = 1: every window matches
    # 0/1 counts added up: exact in any order, so the result is deterministic on any device
    return banned.scatter_add_(1, windows[..., -1], matches.float()) > 0


@dataclass(frozen=True)
class Sampler:
    """Sampling the next token: top-k (0 = no cut; exactly k tokens, as fairseq), then nucleus top-p
    (1.0 = no cut) over what is left, renormalized, from the step's (temperature-scaled) distribution;
    `generator` fixes the draws (None: torch's global RNG)."""

    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def __call__(self, log_probs: Tensor) -> Tensor:
        """log_probs (N, V) -> sampled tokens (N,) long. With top-k only the (N, k) best are drawn from
        (no pass over the vocabulary beyond `topk`); top-p works on the sorted candidates."""
        vocab_size = log_probs.shape[-1]
        if 0 < self.top_k < vocab_size:
            candidates, tokens = log_probs.topk(self.top_k, dim=-1)  # (N, k), most likely first
        elif self.top_p < 1.0:
            candidates, tokens = log_probs.sort(dim=-1, descending=True)  # (N, V)
        else:
            return self._race(log_probs)
        if self.top_p < 1.0:
            probs = candidates.softmax(dim=-1)  # renormalized over the candidates
            mass_before = probs.cumsum(dim=-1) - probs  # (N, k) probability of the candidates above
            candidates = candidates.masked_fill(mass_before >= self.top_p, -math.inf)  # the first stays
        return tokens.gather(1, self._race(candidates).unsqueeze(1)).squeeze(1)

    def _race(self, log_probs: Tensor) -> Tensor:
        """(N, C) -> (N,) index of a draw from softmax(log_probs): the exponential race, argmax of p / E
        with E ~ Exp(1), a draw from p with no host sync (torch.multinomial checks its input)."""
        noise = torch.empty_like(log_probs).exponential_(generator=self.generator)  # (N, C)
        return (log_probs.exp() / noise).max(dim=-1).indices
