"""Greedy and beam search over the decoder's KV cache, batched, with per-sentence stopping.

Both share one step (`_next_log_probs`): one new position through the cached decoder, log-softmax,
pad/BOS banned, EOS forced at a sentence's maximum length. Hypotheses are returned without the
leading BOS, ending with EOS, right-padded with pad_id. Sentences that finish leave the batch, so
the work shrinks as decoding goes and no sentence's result depends on the others in its batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from transformer.model import DecoderCache, Seq2SeqTransformer


@contextmanager
def _eval_mode(model: Seq2SeqTransformer) -> Iterator[None]:
    """Decode without dropout and gradients, then restore the model's training flag."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _max_lengths(model: Seq2SeqTransformer, src: Tensor, max_len_a: float, max_len_b: float) -> Tensor:
    """Per sentence (B,) long: at most floor(a * src_len + b) tokens, EOS included (src_len = non-pad).

    Capped so that BOS plus every token fed back fits in the model's max_len positions.
    """
    src_lengths = src.ne(model.config.pad_id).sum(dim=1)  # (B,)
    limit = (src_lengths.double() * max_len_a + max_len_b).floor().long()  # float64: 1.2 * 10 stays 12
    return limit.clamp(min=1, max=model.config.max_len)


def _next_log_probs(
    model: Seq2SeqTransformer,
    last_tokens: Tensor,
    memory: Tensor,
    src_padding_mask: Tensor,
    cache: DecoderCache,
    at_max_length: Tensor,
) -> Tensor:
    """The shared search step: last_tokens (N,) -> log-probabilities of the next token (N, V), float32.

    `at_max_length` (N,) bool rows may only produce EOS (keeping its real log-probability).
    """
    config = model.config
    logits = model.decode(last_tokens.unsqueeze(1), memory, src_padding_mask, cache)  # (N, 1, V)
    log_probs = logits[:, -1].float().log_softmax(dim=-1)  # (N, V)
    log_probs[:, [config.pad_id, config.bos_id]] = -math.inf  # never emitted: they would break the layout
    if at_max_length.any():
        eos = log_probs[:, config.eos_id].clone()
        log_probs.masked_fill_(at_max_length.unsqueeze(1), -math.inf)
        log_probs[:, config.eos_id] = torch.where(at_max_length, eos, log_probs[:, config.eos_id])
    return log_probs


SEARCHES = ("auto", "greedy", "beam")  # auto: greedy search for beam_size 1, beam search otherwise


@dataclass(frozen=True, eq=False)
class DecodingSettings(Mapping[str, Any]):
    """How to decode: the one settings type of validation and test (`model.decoding`,
    `model.test_decoding`), of `evaluate.py` (`decode.*`, `configs/decode/`) and of the exports.

    A read-only mapping of its fields, so that it is stored in checkpoints and reports as plain data.
    Defaults: greedy search (beam 1), GNMT length penalty alpha 0.6 for beam search, at most
    1.2 * source length + 10 tokens.
    """

    search: str = "auto"  # auto | greedy | beam (auto: greedy for beam_size 1, beam search otherwise)
    beam_size: int = 1
    length_penalty: float = 0.6  # alpha of ((5 + len) / 6) ** alpha
    max_len_a: float = 1.2  # a hypothesis may have up to max_len_a * source length + max_len_b tokens
    max_len_b: float = 10.0

    def __post_init__(self) -> None:
        _check_settings(dict(self))

    @classmethod
    def from_values(
        cls, values: Mapping[str, Any] | None, base: Mapping[str, Any] | None = None, prefix: str = ""
    ) -> DecodingSettings:
        """`base` (the defaults where it has no value) with the non-null `values` on top. An unknown key
        or a value that cannot work raises ValueError naming `<prefix><key>`."""
        merged = {**cls().__dict__, **{k: v for k, v in (base or {}).items() if v is not None}}
        for key, value in (values or {}).items():
            if key not in merged:
                raise ValueError(f"unknown decoding option {prefix}{key}; expected some of {list(merged)}")
            if value is not None:
                merged[key] = value
        _check_settings(merged, prefix)
        return cls(**merged)

    @property
    def greedy(self) -> bool:
        return self.search == "greedy" or (self.search == "auto" and self.beam_size == 1)

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


def _check_settings(settings: Mapping[str, Any], prefix: str = "") -> None:
    """Raise ValueError naming `<prefix><key>` for a decoding setting that cannot work."""
    beam_size = settings.get("beam_size", 1)
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"{prefix}beam_size must be an integer >= 1, got {beam_size!r}")
    search = settings.get("search", "auto")
    if search not in SEARCHES:
        raise ValueError(f"{prefix}search must be one of {list(SEARCHES)}, got {search!r}")
    if search == "greedy" and beam_size != 1:
        raise ValueError(f"{prefix}search=greedy keeps one hypothesis, but {prefix}beam_size={beam_size}")
    for key in ("length_penalty", "max_len_a", "max_len_b"):
        value = settings.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{prefix}{key} must be a finite number, got {value!r}")
        if key != "length_penalty" and value < 0:
            raise ValueError(f"{prefix}{key} must be >= 0, got {value!r}")


@torch.no_grad()
def decode(model: Seq2SeqTransformer, src: Tensor, settings: DecodingSettings) -> Tensor:
    """src (B, S) -> the best hypothesis of each sentence (B, L) as `settings` say: token ids after BOS,
    EOS-terminated, pad-filled."""
    lengths = {"max_len_a": settings.max_len_a, "max_len_b": settings.max_len_b}
    if settings.greedy:
        return greedy_search(model, src, **lengths)
    tokens, _ = beam_search(
        model, src, beam_size=settings.beam_size, length_penalty=settings.length_penalty, **lengths
    )
    return tokens[:, 0]  # (B, L) the best of the beam


def _check_lengths(max_len_a: float, max_len_b: float) -> None:
    if max_len_a < 0 or max_len_b < 0:
        raise ValueError(f"max_len_a ({max_len_a}) and max_len_b ({max_len_b}) must be >= 0")


def greedy_search(
    model: Seq2SeqTransformer, src: Tensor, *, max_len_a: float = 1.2, max_len_b: float = 10
) -> Tensor:
    """src (B, S) long -> hypotheses (B, L) long: the most likely token at each step, until EOS.

    Rows hold the tokens after BOS, ending with EOS (forced at the sentence's max length
    floor(max_len_a * src_len + max_len_b)), then pad_id; L is the longest hypothesis.
    """
    _check_lengths(max_len_a, max_len_b)
    config = model.config
    with _eval_mode(model):
        batch = src.size(0)
        max_lengths = _max_lengths(model, src, max_len_a, max_len_b)  # (B,)
        src_padding_mask = model.padding_mask(src)  # (B, S)
        memory = model.encode(src)  # (B, S, D); projected once into the cross-attention caches
        cache = model.new_cache()
        cache.reserve(int(max_lengths.max()) if batch else 0)
        hypotheses = src.new_full((batch, int(max_lengths.max()) if batch else 0), config.pad_id)
        rows = torch.arange(batch, device=src.device)  # original sentence of each row still decoding
        last_tokens = src.new_full((batch,), config.bos_id)  # (N,)
        step = 0
        while rows.numel():
            at_max_length = max_lengths[rows] == step + 1
            log_probs = _next_log_probs(model, last_tokens, memory, src_padding_mask, cache, at_max_length)
            last_tokens = log_probs.max(dim=-1).indices  # (N,) the argmax (first of ties), 2-3x faster on CPU
            hypotheses[rows, step] = last_tokens
            step += 1
            finished = last_tokens == config.eos_id
            if finished.any():  # drop finished sentences from the batch and the caches
                keep = (~finished).nonzero().squeeze(1)  # (N',)
                rows, last_tokens = rows[keep], last_tokens[keep]
                src_padding_mask = src_padding_mask[keep]
                cache.reorder(keep)
        return hypotheses[:, :step]


def beam_search(
    model: Seq2SeqTransformer,
    src: Tensor,
    *,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len_a: float = 1.2,
    max_len_b: float = 10,
    n_best: int = 1,
) -> tuple[Tensor, Tensor]:
    """src (B, S) long -> (hypotheses (B, n_best, L) long, scores (B, n_best) float), best first.

    Score = sum of token log-probabilities / ((5 + len) / 6) ** length_penalty (Wu et al., 2016),
    len counting EOS. Each step ranks the 2 * beam_size best extensions: EOS ones among the first
    beam_size end a hypothesis, the best beam_size others live on (so EOS never crowds out live
    beams, as in fairseq). A sentence stops at its max length floor(max_len_a * src_len + max_len_b)
    (EOS forced), or once beam_size hypotheses have ended and none of its live beams, normalized at
    the current length, beats the beam_size-th of them (Hugging Face's default heuristic; exact when
    length_penalty=0). beam_size=1 reproduces `greedy_search` token for token. A sentence with fewer
    than n_best finished hypotheses (possible only for tiny max lengths) gets pad_id rows scored -inf.
    """
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be an integer >= 1, got {beam_size!r}")
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be between 1 and beam_size ({beam_size}), got {n_best!r}")
    _check_lengths(max_len_a, max_len_b)
    with _eval_mode(model):
        return _beam_search(model, src, beam_size, length_penalty, max_len_a, max_len_b, n_best)


def _beam_search(
    model: Seq2SeqTransformer,
    src: Tensor,
    beam_size: int,
    length_penalty: float,
    max_len_a: float,
    max_len_b: float,
    n_best: int,
) -> tuple[Tensor, Tensor]:
    config, device, batch = model.config, src.device, src.size(0)
    max_lengths = _max_lengths(model, src, max_len_a, max_len_b)  # (B,)
    # (B, S), then (n, S) for the live sentences: the beams of a sentence share its memory row
    sentence_padding_mask = src_padding_mask = model.padding_mask(src)
    memory, cache = _encode(model, src, max_lengths, beam_size)
    finished: list[list[tuple[float, Tensor]]] = [[] for _ in range(batch)]  # per sentence: (score, tokens)
    kth_best = torch.full((batch,), -math.inf, device=device)  # K-th best finished score, once there are K

    # The live state: n sentences, each with `beams` rows (1 at the first step: all beams would be equal).
    sentences = torch.arange(batch, device=device)  # (n,) original index of each live sentence
    beams, step = 1, 0
    scores = torch.zeros(batch, 1, device=device)  # (n, beams) summed log-probabilities
    prefixes = src.new_empty(batch, 0)  # (n * beams, t) tokens generated so far
    per_beam = min(2 * beam_size, config.tgt_vocab_size)  # tokens considered per beam
    while sentences.numel():
        n = sentences.numel()
        at_max_length = (max_lengths[sentences] == step + 1).repeat_interleave(beams)  # (n * beams,)
        last_tokens = prefixes[:, -1] if step else src.new_full((n,), config.bos_id)
        log_probs = _next_log_probs(model, last_tokens, memory, src_padding_mask, cache, at_max_length)

        # 1. the 2K best candidates of each sentence: their scores, tokens and parent beams
        n_candidates = min(2 * beam_size, beams * per_beam)
        cand_scores, cand_tokens, cand_parents = _candidates(log_probs, scores, per_beam, n_candidates)
        cand_rows = torch.arange(n, device=device).unsqueeze(1) * beams + cand_parents  # (n, 2K) in prefixes

        # 2. EOS among the K best candidates ends a hypothesis (-inf ones are dead beams' leftovers)
        length = step + 1
        normalizer = ((5.0 + length) / 6.0) ** length_penalty
        is_eos = cand_tokens == config.eos_id  # (n, 2K)
        ended = is_eos[:, :beam_size] & torch.isfinite(cand_scores[:, :beam_size])  # (n, K)
        for i, k in ended.nonzero().tolist():
            tokens = torch.cat([prefixes[cand_rows[i, k]], cand_tokens[i, k : k + 1]])
            score = cand_scores[i, k].item() / normalizer
            _finish(finished, kth_best, beam_size, int(sentences[i]), score, tokens)

        # 3. the K best non-EOS candidates live on
        beams = min(beam_size, n_candidates)
        pick, new_tokens, scores = _survivors(cand_scores, cand_tokens, is_eos, beams)  # each (n, K)

        # 4. a sentence is done at its max length, or once K hypotheses ended and its best live beam,
        #    normalized at the current length, scores below the K-th of them (exact for
        #    length_penalty=0; with one beam it stops exactly where greedy search stops)
        done = (max_lengths[sentences] <= length) | (kth_best[sentences] >= scores[:, 0] / normalizer)
        live = (~done).nonzero().squeeze(1)  # (n',)
        if not live.numel():
            break
        rows = cand_rows.gather(1, pick)[live].view(-1)  # (n' * K,) parent rows of the new beams
        prefixes = torch.cat([prefixes[rows], new_tokens[live].view(-1, 1)], dim=1)  # (n' * K, t + 1)
        sentences, scores = sentences[live], scores[live]  # (n',), (n', K)
        # a beam's parent is a beam of the same sentence: the caches (one row per sentence) only lose
        # the sentences that are done, and each new beam points at its parent's keys
        src_padding_mask = sentence_padding_mask[sentences]  # (n', S)
        cache.select_beams(cand_parents.gather(1, pick)[live], live)
        step += 1
    return _pack(finished, n_best, config.pad_id, device)


def _encode(
    model: Seq2SeqTransformer, src: Tensor, max_lengths: Tensor, beam_size: int
) -> tuple[Tensor, DecoderCache]:
    """The encoder memory (B, S, D) and a decoder cache with room for the longest search: one row per
    sentence, shared by its beams (`DecoderCache.select_beams`); BOS, then K keys per step."""
    memory = model.encode(src)
    cache = model.new_cache()
    cache.reserve(1 + (int(max_lengths.max()) - 1) * beam_size if src.size(0) else 0)
    return memory, cache


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


def _finish(
    finished: list[list[tuple[float, Tensor]]],
    kth_best: Tensor,
    beam_size: int,
    sentence: int,
    score: float,
    tokens: Tensor,
) -> None:
    """Record an ended hypothesis of `sentence`; once it has K (beam_size) of them, `kth_best` holds the
    bar a live beam must clear: the K-th best normalized score."""
    finished[sentence].append((score, tokens))
    if len(finished[sentence]) >= beam_size:
        kth_best[sentence] = sorted(score for score, _ in finished[sentence])[-beam_size]


def _pack(
    finished: list[list[tuple[float, Tensor]]], n_best: int, pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The n_best highest-scoring hypotheses per sentence -> (B, n_best, L) padded, scores (B, n_best)."""
    batch = len(finished)
    best = [sorted(hyps, key=lambda hyp: hyp[0], reverse=True)[:n_best] for hyps in finished]
    length = max((len(tokens) for hyps in best for _, tokens in hyps), default=0)
    hypotheses = torch.full((batch, n_best, length), pad_id, dtype=torch.long, device=device)
    scores = torch.full((batch, n_best), -math.inf, device=device)
    for b, hyps in enumerate(best):
        for k, (score, tokens) in enumerate(hyps):
            hypotheses[b, k, : len(tokens)] = tokens
            scores[b, k] = score
    return hypotheses, scores
