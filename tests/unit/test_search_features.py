"""Sampling, n-best lists, ensembles and the step constraints (min_len, no_repeat_ngram_size), each
against a plain reference: recomputed full-prefix decoding, teacher-forced scores, exact sampling
frequencies, and Python n-gram bookkeeping."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.helpers.tiny import tiny_seq2seq
from transformer.model import Seq2SeqTransformer
from transformer.search.decoding import DecodingSettings, beam_search, decode, greedy_search, sample, search
from transformer.search.ensemble import Ensemble
from transformer.search.step import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")

PAD, BOS, EOS = 0, 1, 2
VOCAB = 20


def _model(seed: int, scale: float = 3.0, **overrides: Any) -> Seq2SeqTransformer:
    return tiny_seq2seq(seed, vocab=VOCAB, peaked=scale, max_len=48, **overrides)


def _sources(batch: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    src = torch.full((batch, 12), PAD)
    for row in range(batch):
        length = int(torch.randint(1, 10, (1,), generator=generator))
        src[row, 0], src[row, length + 1] = BOS, EOS
        src[row, 1 : length + 1] = torch.randint(4, VOCAB, (length,), generator=generator)
    return src


def _rows(hypotheses: torch.Tensor) -> list[list[int]]:
    """Token lists up to and including EOS."""
    rows = []
    for row in hypotheses.tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else [t for t in row if t != PAD])
    return rows


def _teacher_forced_score(
    model: torch.nn.Module, src: torch.Tensor, tokens: list[int], alpha: float
) -> float:
    """Sum of the hypothesis' log-probabilities (one full forward pass) / ((5 + len) / 6) ** alpha."""
    tgt_in = torch.tensor([[BOS, *tokens[:-1]]])
    with torch.no_grad():
        log_probs = model(src.unsqueeze(0), tgt_in)[0].float().log_softmax(-1)  # (T, V)
    total = log_probs.gather(1, torch.tensor(tokens).unsqueeze(1)).sum().item()
    return total / ((5 + len(tokens)) / 6) ** alpha


# --- sampling ---------------------------------------------------------------------------------------


def test_top_k_one_is_greedy_search() -> None:
    model, src = _model(0), _sources(16)
    greedy = greedy_search(model, src, max_len_b=20)
    for temperature in (1.0, 0.5):
        sampled, _ = sample(model, src, top_k=1, temperature=temperature, max_len_b=20)
        assert torch.equal(sampled[:, 0], greedy)


def test_the_seed_fixes_the_samples_and_another_seed_changes_them() -> None:
    model, src = _model(0, scale=0.5), _sources(16)  # flat distributions: draws differ

    def draw(seed: int) -> torch.Tensor:
        return sample(model, src, max_len_b=15, generator=torch.Generator().manual_seed(seed))[0]

    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))
    torch.manual_seed(3)  # no generator: torch's global RNG, as the entry points seed it
    first = sample(model, src, max_len_b=15)[0]
    torch.manual_seed(3)
    assert torch.equal(first, sample(model, src, max_len_b=15)[0])


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [
        (0, 1.0, [0.4, 0.3, 0.2, 0.1]),
        (2, 1.0, [0.4, 0.3, 0, 0]),
        (0, 0.65, [0.4, 0.3, 0, 0]),
        (0, 0.75, [0.4, 0.3, 0.2, 0]),
        (3, 0.5, [0.4, 0.3, 0, 0]),
        (2, 0.55, [1.0, 0, 0, 0]),  # top-p over the top-2 renormalized: 0.4 / 0.7 >= 0.55 already
        (0, 0.1, [1.0, 0, 0, 0]),
    ],
)
def test_sampler_draws_from_the_truncated_distribution(top_k: int, top_p: float, kept: list[float]) -> None:
    """Empirical frequencies of 40k draws match the top-k / nucleus distribution, renormalized."""
    probs = torch.tensor([0.3, 0.1, 0.4, 0.2])  # sorted: token 2, 0, 3, 1
    order = [2, 0, 3, 1]
    expected = torch.zeros(4)
    expected[order] = torch.tensor(kept)
    expected /= expected.sum()
    sampler = Sampler(top_k, top_p, torch.Generator().manual_seed(0))
    draws = sampler(probs.log().expand(40_000, 4))
    frequencies = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(frequencies, expected, atol=0.01, rtol=0)
    assert bool((frequencies[expected == 0] == 0).all())


def test_n_samples_per_source_sorted_by_their_own_scores() -> None:
    model, src = _model(0, scale=0.7), _sources(6)
    alpha = 0.6
    tokens, scores = sample(model, src, n_best=5, max_len_b=12, generator=torch.Generator().manual_seed(0))
    assert tokens.shape[:2] == (6, 5) and scores.shape == (6, 5)
    for b in range(6):
        assert scores[b].tolist() == sorted(scores[b].tolist(), reverse=True)
        for k, row in enumerate(_rows(tokens[b])):
            assert math.isclose(
                scores[b, k].item(), _teacher_forced_score(model, src[b], row, alpha), abs_tol=1e-4
            )
        assert len({tuple(r) for r in _rows(tokens[b])}) > 1  # independent draws, not copies


# --- n-best -----------------------------------------------------------------------------------------


def test_beam_n_best_is_ranked_and_scored_like_teacher_forcing() -> None:
    model, src = _model(1), _sources(8)
    settings = DecodingSettings(beam_size=5, n_best=3, length_penalty=1.0, max_len_b=15)
    tokens, scores = search(model, src, settings)
    assert tokens.shape[:2] == (8, 3)
    best_of_beam, best_scores = beam_search(
        model, src, beam_size=5, length_penalty=1.0, max_len_b=15, n_best=5
    )
    torch.testing.assert_close(scores, best_scores[:, :3])
    for b in range(8):
        rows = _rows(tokens[b])
        assert rows == _rows(best_of_beam[b])[:3] and len(set(map(tuple, rows))) == 3
        assert scores[b].tolist() == sorted(scores[b].tolist(), reverse=True)
        for k, row in enumerate(rows):
            assert math.isclose(
                scores[b, k].item(), _teacher_forced_score(model, src[b], row, 1.0), abs_tol=1e-4
            )


def test_greedy_scores_are_beam_one_scores() -> None:
    model, src = _model(2), _sources(10)
    greedy_tokens, greedy_scores = search(model, src, DecodingSettings(search="greedy", max_len_b=15))
    beam_tokens, beam_scores = beam_search(model, src, beam_size=1, max_len_b=15)
    assert torch.equal(greedy_tokens, beam_tokens)
    torch.testing.assert_close(greedy_scores, beam_scores)


# --- ensembles --------------------------------------------------------------------------------------


def _reference_ensemble_greedy(
    models: list[Seq2SeqTransformer], weights: list[float], src: torch.Tensor, limit: int
) -> list[list[int]]:
    """Per sentence, no cache: every step recomputes each model over the whole prefix and averages the
    probabilities."""
    out = []
    total = sum(weights)
    for sentence in src:
        prefix = [BOS]
        while len(prefix) <= limit:
            with torch.no_grad():
                probs = sum(
                    w / total * m(sentence.unsqueeze(0), torch.tensor([prefix]))[0, -1].float().softmax(-1)
                    for m, w in zip(models, weights)
                )
            probs[[PAD, BOS]] = 0
            if len(prefix) == limit:
                probs[:] = 0
                probs[EOS] = 1
            prefix.append(int(probs.argmax()))
            if prefix[-1] == EOS:
                break
        out.append(prefix[1:])
    return out


def test_ensemble_greedy_is_the_mean_of_the_models_probabilities() -> None:
    models = [
        _model(0),
        _model(1, d_model=16, n_encoder_layers=1, n_heads=2),
        _model(2, positional="learned"),
    ]
    src = _sources(6)
    for weights in ([1.0, 1.0, 1.0], [0.5, 2.0, 1.0]):
        ours = greedy_search(Ensemble(models, weights), src, max_len_a=0, max_len_b=10)
        assert _rows(ours) == _reference_ensemble_greedy(models, weights, src, 10)


@pytest.mark.parametrize(
    "settings", [{"beam_size": 1}, {"beam_size": 4, "n_best": 2}, {"search": "sample", "top_k": 5}]
)
def test_a_self_ensemble_decodes_like_its_model(settings: dict[str, object]) -> None:
    model, src = _model(3), _sources(12)
    settings_ = DecodingSettings(max_len_b=15, **settings)  # type: ignore[arg-type]
    alone = search(model, src, settings_, torch.Generator().manual_seed(0))
    twice = search(Ensemble([model, model]), src, settings_, torch.Generator().manual_seed(0))
    assert torch.equal(alone[0], twice[0])
    torch.testing.assert_close(alone[1], twice[1], atol=1e-5, rtol=0)


def test_zero_weight_silences_a_model() -> None:
    first, second, src = _model(0), _model(1), _sources(8)
    settings = DecodingSettings(beam_size=3, max_len_b=15)
    assert torch.equal(
        decode(Ensemble([first, second], [1.0, 0.0]), src, settings), decode(first, src, settings)
    )


def test_ensemble_refuses_models_that_cannot_be_averaged() -> None:
    with pytest.raises(ValueError, match="model 1 of the ensemble has src_vocab_size=21"):
        Ensemble([_model(0), _model(1, src_vocab_size=VOCAB + 1, tgt_vocab_size=VOCAB + 1)])
    with pytest.raises(ValueError, match="ensemble_weights has 1 values for 2 models"):
        Ensemble([_model(0), _model(1)], [1.0])
    with pytest.raises(ValueError, match="ensemble_weights must be >= 0"):
        Ensemble([_model(0), _model(1)], [1.0, -1.0])


# --- step constraints -------------------------------------------------------------------------------


def _ngrams(row: list[int], n: int) -> list[tuple[int, ...]]:
    row = [BOS, *row]
    return [tuple(row[i : i + n]) for i in range(len(row) - n + 1)]


@pytest.mark.parametrize("settings", [{"beam_size": 1}, {"beam_size": 4}, {"search": "sample"}])
def test_no_repeat_ngram_size_leaves_no_repeated_ngram(settings: dict[str, object]) -> None:
    model, src = _model(4, scale=1.0), _sources(16)  # a random model repeats itself a lot
    for n in (1, 2, 3):
        plain = search(
            model, src, DecodingSettings(max_len_b=25, **settings), torch.Generator().manual_seed(0)
        )[0]  # type: ignore[arg-type]
        if n == 2:
            assert any(len(set(_ngrams(r, 2))) < len(_ngrams(r, 2)) for r in _rows(plain[:, 0]))
        blocked = search(
            model,
            src,
            DecodingSettings(max_len_b=25, no_repeat_ngram_size=n, **settings),
            torch.Generator().manual_seed(0),  # type: ignore[arg-type]
        )[0]
        for row in _rows(blocked[:, 0]):
            grams = _ngrams(row[:-1] if row[-1] == EOS else row, n)  # EOS ends the row: outside the rule
            assert len(set(grams)) == len(grams), (n, row)


def test_no_repeat_ngram_greedy_matches_a_python_reference() -> None:
    model, src, n = _model(5, scale=1.0), _sources(8), 2
    ours = _rows(greedy_search(model, src, max_len_a=0, max_len_b=14, no_repeat_ngram_size=n))
    for sentence, row in zip(src, ours):
        prefix = [BOS]
        while True:
            with torch.no_grad():
                log_probs = model(sentence.unsqueeze(0), torch.tensor([prefix]))[0, -1].log_softmax(-1)
            log_probs[[PAD, BOS]] = -math.inf
            for gram in _ngrams(prefix[1:], n):
                if list(gram[:-1]) == prefix[len(prefix) - n + 1 :]:
                    log_probs[gram[-1]] = -math.inf
            if len(prefix) == 14:
                prefix.append(EOS)
            else:
                prefix.append(int(log_probs.argmax()))
            if prefix[-1] == EOS:
                break
        assert row == prefix[1:]


@pytest.mark.parametrize("settings", [{"beam_size": 1}, {"beam_size": 3}, {"search": "sample"}])
def test_min_len_bans_early_eos_but_not_the_max_length(settings: dict[str, object]) -> None:
    model, src = _model(6), _sources(32)
    favourite = greedy_search(model, src, max_len_b=20).flatten().mode().values  # the most generated token
    with torch.no_grad():  # EOS a little likelier than it: hypotheses end early
        model.output_projection.weight[EOS] = model.output_projection.weight[favourite] * 1.1
    plain = search(model, src, DecodingSettings(max_len_b=20, **settings))[0]  # type: ignore[arg-type]
    assert min(len(r) for r in _rows(plain[:, 0])) < 7  # some end early: min_len has something to do
    longer = search(model, src, DecodingSettings(max_len_b=20, min_len=6, **settings))[0]  # type: ignore[arg-type]
    assert min(len(r) for r in _rows(longer[:, 0])) >= 7  # 6 tokens, then EOS at the earliest
    capped = search(model, src, DecodingSettings(max_len_a=0, max_len_b=3, min_len=6, **settings))[0]  # type: ignore[arg-type]
    assert all(len(r) == 3 and r[-1] == EOS for r in _rows(capped[:, 0]))  # max length wins


def test_an_ensemble_is_built_for_inference() -> None:
    """Built in eval mode, so decoding through it cannot leave its members training (dropout on)."""
    member = _model(0).train()
    ensemble = Ensemble([member, _model(1)])
    assert not ensemble.training and not member.training
    greedy_search(ensemble, _sources(2), max_len_b=3)
    assert not member.training
