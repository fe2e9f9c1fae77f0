"""Searches over hand-made next-token distributions, checked against values computed by hand: the exact
top-k + nucleus distribution the sampler draws from, which way the temperature acts (one model and an
ensemble), the step at which `min_len` first allows EOS (greedy, beam, dynamic and static cache), and beam
search's 2K candidates keeping K live beams when some of the best end (a Markov model over tokens).

The model is a real `Seq2SeqTransformer` (its caches, static or dynamic, run as usual) whose next-token
logits are replaced by a fixed vector, so every expectation is a few lines of arithmetic."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from transformer.config import TransformerConfig
from transformer.kv_cache import DecoderCache
from transformer.model import Seq2SeqTransformer
from transformer.search.decoding import DecodingSettings, sample, search
from transformer.search.ensemble import Ensemble
from transformer.search.step import Sampler, StepRules, next_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")

PAD, BOS, EOS = 0, 1, 2
VOCAB = 8


class _HandMadeLogits(Seq2SeqTransformer):
    """A Seq2SeqTransformer whose next-token logits after token t are `logits[t]` ((V, V): row t for the
    last token t; the same row everywhere for fixed logits): the decoder still runs (the caches fill as
    usual), only its output is replaced."""

    logits: Tensor

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        src_padding_mask: Tensor | None,
        cache: DecoderCache | None = None,
        *,
        return_hidden: bool = False,
    ) -> Tensor:
        out = super().decode(tgt_in, memory, src_padding_mask, cache, return_hidden=return_hidden)
        return torch.zeros_like(out) + self.logits[tgt_in]  # (B, T, V)


def _fixed(logits: list[float], seed: int = 0) -> _HandMadeLogits:
    torch.manual_seed(seed)
    config = TransformerConfig(
        VOCAB,
        VOCAB,
        d_model=16,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=1,
        d_ff=32,
        dropout=0.0,
        max_len=32,
    )
    model = _HandMadeLogits(config).eval()
    model.logits = torch.tensor(logits).expand(VOCAB, VOCAB)  # whatever the last token
    return model


def _src(batch: int) -> Tensor:
    return torch.tensor([[BOS, 5, 6, EOS]]).expand(batch, 4).contiguous()


# --- top-k and nucleus --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top_k", "top_p", "expected"),
    [
        # top-2 renormalized: 4/7, 3/7; nucleus 0.5 keeps the first alone (mass above the 2nd: 4/7 >= 0.5).
        # Without renormalization the mass above the 2nd would be 0.4 < 0.5 and both would stay.
        (2, 0.5, {2: 1.0}),
        # top-3 of [.35 .25 .2 .1 .1] renormalized: .4375 .3125 .25; nucleus 0.7 stops after two
        # (mass above the 3rd: .75 >= .7; unrenormalized it would be .6 < .7 and three would stay)
        (3, 0.7, {2: 0.35 / 0.6, 0: 0.25 / 0.6}),
        (0, 0.7, {2: 0.35 / 0.8, 0: 0.25 / 0.8, 3: 0.2 / 0.8}),  # nucleus alone: .35 + .25 < .7
        (3, 1.0, {2: 0.35 / 0.8, 0: 0.25 / 0.8, 3: 0.2 / 0.8}),  # top-k alone
    ],
)
def test_top_k_then_nucleus_draws_from_the_renormalized_top_k(
    top_k: int, top_p: float, expected: dict[int, float]
) -> None:
    """The frequencies of n draws equal the hand-computed distribution within 5 standard deviations of
    a frequency, sqrt(p (1 - p) / n); excluded tokens are never drawn."""
    probs = torch.zeros(VOCAB)
    probs[[2, 0, 3, 4, 5]] = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.1])
    n = 40_000
    draws = Sampler(top_k, top_p, torch.Generator().manual_seed(0))(probs.log().expand(n, VOCAB))
    frequencies = torch.bincount(draws, minlength=VOCAB).double() / n
    target = torch.zeros(VOCAB, dtype=torch.double)
    for token, p in expected.items():
        target[token] = p
    tolerance = 5 * (target * (1 - target) / n).sqrt()
    assert bool(((frequencies - target).abs() <= tolerance).all()), (frequencies, target)


# --- temperature --------------------------------------------------------------------------------------

LOGITS = [-9.0, -9.0, 0.5, 2.0, 1.0, 0.0, -1.0, 1.5]  # PAD and BOS out of the way


def _step(model: Seq2SeqTransformer | Ensemble, temperature: float) -> Tensor:
    """next_log_probs of the first step at `temperature`: (V,) float."""
    src = _src(1)
    with torch.no_grad():
        memory = model.encode(src)
        rules = StepRules(PAD, BOS, EOS, temperature=temperature)
        last = torch.tensor([BOS])
        return next_log_probs(
            model, last, memory, model.padding_mask(src), model.new_cache(), rules, 0, None
        )[0]


def _expected(logits: list[float], temperature: float) -> Tensor:
    log_probs = (torch.tensor(logits) / temperature).log_softmax(-1)
    log_probs[[PAD, BOS]] = -math.inf
    return log_probs


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_divides_the_logits(temperature: float) -> None:
    """Lower temperature sharpens: the favourite's probability rises, the entropy falls; higher flattens."""
    model = _fixed(LOGITS)
    at_t, at_one = _step(model, temperature), _step(model, 1.0)
    torch.testing.assert_close(at_t, _expected(LOGITS, temperature))
    favourite = int(at_one.argmax())
    assert favourite == 3
    sharper = at_t if temperature < 1 else at_one
    flatter = at_one if temperature < 1 else at_t
    assert sharper[favourite] > flatter[favourite]
    assert _entropy(sharper) < _entropy(flatter)


def _entropy(log_probs: Tensor) -> float:
    probs = log_probs.exp()
    return float(-(probs * log_probs.masked_fill(probs == 0, 0)).sum())


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_an_ensemble_mixes_its_models_at_the_temperature(temperature: float) -> None:
    """log of the weighted mean of softmax(logits_i / T): each model is sharpened before mixing."""
    other = [1.0, -9.0, 0.0, 1.0, 2.5, 0.0, -2.0, 0.5]
    ensemble = Ensemble([_fixed(LOGITS, seed=0), _fixed(other, seed=1)], [1.0, 3.0])
    mixed = _step(ensemble, temperature)
    probs = 0.25 * (torch.tensor(LOGITS) / temperature).softmax(-1) + 0.75 * (
        torch.tensor(other) / temperature
    ).softmax(-1)
    expected = probs.log()
    expected[[PAD, BOS]] = -math.inf
    torch.testing.assert_close(mixed, expected)
    at_one = _step(ensemble, 1.0)
    favourite = int(at_one.argmax())  # token 4: both models like it
    sharper, flatter = (mixed, at_one) if temperature < 1 else (at_one, mixed)
    assert sharper[favourite] > flatter[favourite] and _entropy(sharper) < _entropy(flatter)


def test_sampling_at_a_lower_temperature_draws_the_favourite_more_often() -> None:
    """Through the whole search: the first sampled token's frequencies over n rows are
    softmax(logits / T) within 5 standard deviations."""
    model, n = _fixed(LOGITS), 4000
    for temperature in (0.5, 1.0, 2.0):
        tokens, _ = sample(
            model, _src(n), temperature=temperature, max_len_a=0, max_len_b=2,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        frequencies = torch.bincount(tokens[:, 0, 0], minlength=VOCAB).double() / n
        target = _expected(LOGITS, temperature).double().exp()
        assert bool(((frequencies - target).abs() <= 5 * (target * (1 - target) / n).sqrt()).all()), (
            temperature, frequencies, target,
        )  # fmt: skip


# --- min_len ------------------------------------------------------------------------------------------

EOS_FIRST = [-9.0, -9.0, 3.0, -1.0, -2.0, 1.0, -2.0, -3.0]  # EOS, then token 5, by far


@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
@pytest.mark.parametrize("beam_size", [1, 3])
@pytest.mark.parametrize("min_len", [0, 1, 4])
def test_eos_is_allowed_exactly_at_min_len(kv_cache: str, beam_size: int, min_len: int) -> None:
    """A model that always prefers EOS, then token 5: with `min_len` m the best hypothesis is m fives and
    EOS, scored (m * log p(5) + log p(EOS)) / ((5 + m + 1) / 6) ** alpha (computed by hand here)."""
    model = _fixed(EOS_FIRST)
    settings = DecodingSettings(
        beam_size=beam_size, min_len=min_len, length_penalty=1.0, max_len_a=0, max_len_b=10, kv_cache=kv_cache
    )
    tokens, scores = search(model, _src(2), settings)
    log_probs = torch.tensor(EOS_FIRST).log_softmax(-1)
    length = min_len + 1
    expected = (min_len * log_probs[5] + log_probs[EOS]) / ((5 + length) / 6)
    for row in tokens[:, 0].tolist():
        assert row[:length] == [5] * min_len + [EOS], row
    torch.testing.assert_close(scores[:, 0], expected.expand(2))


# --- beam search keeps K live beams when K of its 2K candidates end ----------------------------------


def _markov(rows: dict[int, dict[int, float]]) -> _HandMadeLogits:
    """Next-token probabilities that depend on the last token only: `rows[last][next]`; a row's remaining
    mass goes to PAD (never emitted: lost)."""
    table = torch.full((VOCAB, VOCAB), 1e-6)
    for last, row in rows.items():
        for token, p in row.items():
            table[last, token] = p
        table[last, PAD] = 1.0 - sum(row.values())
    model = _fixed([0.0] * VOCAB)
    model.logits = table.log()
    return model


@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
def test_beam_search_replaces_the_beams_that_end_from_its_2k_candidates(kv_cache: str) -> None:
    """Beam 2, no length penalty. Step 1's best candidates are [3 EOS] (ends), [4 6], [4 EOS] (the third:
    does not end) and [3 5]: the live beams are [4 6] and [3 5], the 1st and 3rd non-EOS candidates, which
    only 2K candidates hold. [3 5] then ends at -3.10 while everything after [4 6] scores -4.34, so the
    2-best list is [3 EOS], [3 5 EOS] (with K+1 candidates [3 5] would be lost and [4 6 ...] second)."""
    model = _markov(
        {
            BOS: {3: 0.5, 4: 0.4, EOS: 0.01},
            3: {EOS: 0.7, 5: 0.1, 4: 0.06, 6: 0.06, 7: 0.06},
            4: {EOS: 0.3, 6: 0.65},
            5: {EOS: 0.9},
            6: {EOS: 0.05, 3: 0.05, 4: 0.05, 5: 0.05, 7: 0.05},
            7: {EOS: 0.9},
        }
    )
    settings = DecodingSettings(
        beam_size=2, n_best=2, length_penalty=0.0, max_len_a=0, max_len_b=10, kv_cache=kv_cache
    )
    tokens, scores = search(model, _src(1), settings)
    assert [[t for t in row if t != PAD] for row in tokens[0].tolist()] == [[3, EOS], [3, 5, EOS]]
    expected = [math.log(0.5 * 0.7), math.log(0.5 * 0.1 * 0.9)]
    torch.testing.assert_close(scores[0], torch.tensor(expected), atol=0, rtol=1e-5)
