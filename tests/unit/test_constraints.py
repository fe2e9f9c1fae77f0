"""Constrained decoding on untrained tiny models (the guarantees hold whatever the model predicts):
prefixes start every output, required phrases appear in every output that can hold them (greedy, beam,
n-best, ensembles), avoided phrases never appear, and no request means today's output token for token."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.helpers.tiny import tiny_seq2seq, tiny_sources
from transformer.search.constraints import ConstraintState, TargetRequest, unsatisfiable
from transformer.search.decoding import DecodingSettings, search
from transformer.search.ensemble import Ensemble
from transformer.search.step import LengthLimits

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 24
BATCH = 12


def _model(seed: int = 0, eos_boost: float = 0.0, **kwargs: object) -> torch.nn.Module:
    """A tiny model; `eos_boost` added to EOS's logit makes it want to stop early (9: many outputs of
    1-8 tokens, where the untrained model alone runs to its maximum length), which the constraints must
    overrule."""
    model = tiny_seq2seq(seed, vocab=VOCAB, **kwargs)
    if eos_boost:

        def boost(module: torch.nn.Module, inputs: object, logits: torch.Tensor) -> torch.Tensor:
            return logits + torch.nn.functional.one_hot(torch.tensor(2), VOCAB) * eos_boost

        model.output_projection.register_forward_hook(boost)
    return model


def _contains(hypothesis: list[int], phrase: tuple[int, ...]) -> bool:
    return any(tuple(hypothesis[i : i + len(phrase)]) == phrase for i in range(len(hypothesis)))


def _tokens(row: torch.Tensor) -> list[int]:
    """One hypothesis without EOS and padding."""
    tokens = row.tolist()
    return tokens[: tokens.index(2)] if 2 in tokens else [t for t in tokens if t]


def _random_phrases(seed: int, count: int, longest: int = 3) -> list[TargetRequest]:
    generator = torch.Generator().manual_seed(seed)

    def phrase() -> tuple[int, ...]:
        length = int(torch.randint(1, longest + 1, (1,), generator=generator))
        return tuple(torch.randint(4, VOCAB, (length,), generator=generator).tolist())

    return [TargetRequest(include=tuple(phrase() for _ in range(count))) for _ in range(BATCH)]


SEARCHES = {
    "greedy": {"beam_size": 1},
    "beam1": {"search": "beam", "beam_size": 1},
    "beam4": {"beam_size": 4},
    "beam5_nbest3": {"beam_size": 5, "n_best": 3},
}


@pytest.mark.parametrize("name", list(SEARCHES))
@pytest.mark.parametrize("eos_boost", [0.0, 9.0])
def test_every_required_phrase_appears_in_every_output(name: str, eos_boost: float) -> None:
    """The best hypothesis holds every phrase, in any order; so does every n-best entry that ended on
    its own (one cut at the maximum length may miss some: they rank after the complete ones)."""
    model, src = _model(eos_boost=eos_boost), tiny_sources(BATCH, vocab=VOCAB)
    requests = _random_phrases(seed=len(name), count=3)
    settings = DecodingSettings(max_len_b=20, **SEARCHES[name])
    tokens, _ = search(model, src, settings, requests=requests)
    limits = LengthLimits.of(model.config, src, settings.max_len_a, settings.max_len_b).per_sentence.tolist()
    assert not unsatisfiable(requests, limits)
    for b, request in enumerate(requests):
        for k in range(tokens.shape[1]):
            hypothesis = _tokens(tokens[b, k])
            met = all(_contains(hypothesis, phrase) for phrase in request.include)
            assert met or (k > 0 and len(hypothesis) + 1 == limits[b]), (b, k, hypothesis, request)
            if k and met:
                assert all(_contains(_tokens(tokens[b, j]), p) for j in range(k) for p in request.include), (
                    "complete hypotheses rank before cut ones"
                )


CONTINUING = tuple(range(14, VOCAB))  # stand-ins for the pieces that continue a word


def _first_end(hypothesis: list[int], phrase: tuple[int, ...]) -> int | None:
    """The position after the phrase's first occurrence (None: it does not occur)."""
    ends = [
        i + len(phrase) for i in range(len(hypothesis)) if tuple(hypothesis[i : i + len(phrase)]) == phrase
    ]
    return ends[0] if ends else None


@pytest.mark.parametrize("name", ["greedy", "beam4", "beam5_nbest3"])
def test_required_phrases_end_at_a_word_end(name: str) -> None:
    """With the tokenizer's word continuations, what follows a required phrase's first occurrence is never
    one of them (a new word, punctuation, EOS); without them, some outputs go on inside the word."""
    model, src = _model(), tiny_sources(BATCH, vocab=VOCAB)
    generator = torch.Generator().manual_seed(3)

    def word() -> tuple[int, ...]:  # a word start (4-13) and 0-2 pieces of any kind, as a tokenizer's word
        rest = torch.randint(
            4, VOCAB, (int(torch.randint(0, 3, (1,), generator=generator)),), generator=generator
        )
        return (int(torch.randint(4, 14, (1,), generator=generator)), *rest.tolist())

    requests = [TargetRequest(include=(word(), word())) for _ in range(BATCH)]
    settings = DecodingSettings(max_len_b=20, **SEARCHES[name])
    after = {}
    for continuations in ((), CONTINUING):
        tokens, _ = search(model, src, settings, requests=requests, word_continuations=continuations)
        after[continuations] = []
        for b, request in enumerate(requests):
            for k in range(tokens.shape[1]):
                hypothesis = [*_tokens(tokens[b, k]), 2]
                for phrase in request.include:
                    end = _first_end(hypothesis, phrase)
                    assert end is not None or k > 0, (b, hypothesis, request)  # n-best: may be cut short
                    if end is not None:
                        after[continuations].append(hypothesis[end])
    assert not set(after[CONTINUING]) & set(CONTINUING)
    assert set(after[()]) & set(CONTINUING)  # the rule had something to do


def test_an_ensemble_meets_the_constraints_too() -> None:
    ensemble = Ensemble([_model(0, eos_boost=9.0), _model(1, eos_boost=9.0, d_model=16, layers=1)])

    def free_token(request: TargetRequest) -> int:  # one no phrase needs (a conflict is unsatisfiable)
        return next(t for t in range(4, VOCAB) if all(t not in phrase for phrase in request.include))

    requests = [
        TargetRequest(prefix=(9,), include=r.include, avoid=((free_token(r),),))
        for r in _random_phrases(7, count=2)
    ]
    for beam in (1, 4):
        tokens, _ = search(
            ensemble,
            tiny_sources(BATCH, vocab=VOCAB),
            DecodingSettings(beam_size=beam, max_len_b=20),
            None,
            requests,
        )
        for b, request in enumerate(requests):
            hypothesis = _tokens(tokens[b, 0])
            assert hypothesis[0] == 9 and request.avoid[0][0] not in hypothesis
            assert all(_contains(hypothesis, phrase) for phrase in request.include), (hypothesis, request)


@pytest.mark.parametrize(
    "settings",
    [{"beam_size": 1}, {"beam_size": 4, "n_best": 2}, {"search": "sample", "n_best": 3, "top_k": 5}],
    ids=["greedy", "beam", "sample"],
)
def test_a_prefix_starts_every_output(settings: dict) -> None:
    prefixes = [tuple(range(4 + b % 3, 8 + b % 3))[: 1 + b % 4] for b in range(BATCH)]
    requests = [TargetRequest(prefix=p) for p in prefixes]
    tokens, scores = search(
        _model(), tiny_sources(BATCH, vocab=VOCAB), DecodingSettings(max_len_b=20, **settings), None, requests
    )
    for b, prefix in enumerate(prefixes):
        for k in range(tokens.shape[1]):
            assert tuple(tokens[b, k, : len(prefix)].tolist()) == prefix
    assert torch.isfinite(scores).all()  # the prefix tokens keep their real log-probabilities


def test_avoided_phrases_never_appear() -> None:
    """Phrases taken from the unconstrained outputs themselves (a bigram and a token of each), so the
    rule has something to remove."""
    model, src = _model(), tiny_sources(BATCH, vocab=VOCAB)
    for settings in (
        DecodingSettings(beam_size=1, max_len_b=20),
        DecodingSettings(beam_size=4, max_len_b=20),
    ):
        free = [_tokens(row) for row in search(model, src, settings)[0][:, 0]]
        requests = [
            TargetRequest(avoid=(tuple(h[1:3]),) if len(h) >= 3 else ((h[0],),)) if h else TargetRequest()
            for h in free
        ]
        requests = [
            TargetRequest(avoid=(*r.avoid, (free[b][-1],))) if free[b] else r for b, r in enumerate(requests)
        ]
        tokens = search(model, src, settings, requests=requests)[0]
        for b, request in enumerate(requests):
            for k in range(tokens.shape[1]):
                hypothesis = _tokens(tokens[b, k])
                assert not any(_contains(hypothesis, phrase) for phrase in request.avoid), (
                    hypothesis,
                    request,
                )


@pytest.mark.parametrize("settings", [{"beam_size": 1}, {"beam_size": 4, "n_best": 4}])
def test_empty_requests_decode_as_today(settings: dict) -> None:
    model, src = _model(), tiny_sources(BATCH, vocab=VOCAB)
    decoding = DecodingSettings(max_len_b=20, **settings)
    plain = search(model, src, decoding)
    empty = search(model, src, decoding, requests=[TargetRequest()] * BATCH)
    assert torch.equal(plain[0], empty[0]) and torch.equal(plain[1], empty[1])


def test_a_broken_off_phrase_is_undone() -> None:
    state = ConstraintState([TargetRequest(include=((7, 8, 9),))] * 3, torch.device("cpu"))
    for tokens in ([7, 7, 7], [8, 7, 8], [5, 8, 9], [9, 9, 9]):  # rows: 7 8 5 9 | 7 7 8 9 | 7 8 9 9
        state.advance(torch.tensor(tokens))
    assert state.met[:, 0].tolist() == [False, True, True]
    assert state.unmet_tokens(torch.arange(3)).tolist() == [3, 0, 0]


def test_unsatisfiable_sentences_are_reported_and_still_decoded() -> None:
    model, src = _model(), tiny_sources(4, vocab=VOCAB)
    settings = DecodingSettings(max_len_a=0.0, max_len_b=4)  # 4 tokens, EOS included
    requests = [TargetRequest(include=((5, 6),)), TargetRequest(prefix=(7,), include=((5, 6), (8,)))] * 2
    limits = LengthLimits.of(model.config, src, 0.0, 4).per_sentence.tolist()
    assert unsatisfiable(requests, limits) == [1, 3]
    tokens = search(model, src, settings, requests=requests)[0][:, 0]
    assert _contains(_tokens(tokens[0]), (5, 6)) and len(_tokens(tokens[1])) == 3


def test_unsupported_combinations_are_refused() -> None:
    model, src = _model(), tiny_sources(2, vocab=VOCAB)
    requests = [TargetRequest(include=((5,),))] * 2
    with pytest.raises(ValueError, match=r"decode\.kv_cache=static"):
        search(model, src, DecodingSettings(kv_cache="static"), requests=requests)
    with pytest.raises(ValueError, match=r"decode\.search=sample"):
        search(model, src, DecodingSettings(search="sample"), requests=requests)


# --- avoided phrases: only the last token, only after the rest -------------------------------------------


def _banned(state: ConstraintState, histories: list[list[int]]) -> list[set[int]]:
    """The tokens `restrict` bans in each row (rows follow `state.sentence`), BOS = 1 before `histories`."""
    history = torch.tensor([[1, *h] for h in histories])  # (N, 1 + t), all of one length
    log_probs = torch.zeros(len(histories), VOCAB)
    state.restrict(log_probs, history.shape[1] - 1, history, eos_id=2)
    return [set(torch.isinf(row).nonzero().flatten().tolist()) for row in log_probs]


def test_an_avoided_phrase_bans_only_its_last_token_right_after_the_rest() -> None:
    """Phrases of 1, 2 and 3 tokens in one request (and a second sentence with its own): a one-token
    phrase is always banned; a longer one bans its last token only where the row's last tokens are the
    rest of it, and never bans its earlier tokens."""
    requests = [
        TargetRequest(avoid=((5,), (6, 7), (8, 9, 10))),
        TargetRequest(avoid=((9, 10),)),
    ]

    def rows_of(sentences: list[int]) -> ConstraintState:  # a state whose rows follow `sentences`
        state = ConstraintState(requests, torch.device("cpu"))
        state.select(torch.tensor(sentences))
        return state

    histories = {  # history (after BOS) -> what sentence 0 / sentence 1 ban next
        (4, 4): ({5}, set()),
        (4, 6): ({5, 7}, set()),
        (6, 7): ({5}, set()),  # right after a whole phrase: its tokens are free again
        (8, 9): ({5, 10}, {10}),  # sentence 1's phrase ends with the same two tokens
        (4, 9): ({5}, {10}),  # 9 without 8: only sentence 1's two-token phrase applies
        (4, 8): ({5}, set()),  # the start of the three-token phrase bans neither 9 nor 8
        (9, 8): ({5}, set()),
        (7, 6): ({5, 7}, set()),
    }
    for sentence in (0, 1):
        got = _banned(rows_of([sentence] * len(histories)), [list(h) for h in histories])
        assert got == [expected[sentence] for expected in histories.values()], sentence
    both = rows_of([0, 1, 0, 1])  # rows of both sentences in one batch
    assert _banned(both, [[8, 9], [8, 9], [4, 6], [4, 6]]) == [{5, 10}, {10}, {5, 7}, set()]
    assert _banned(both, [[], [], [], []]) == [{5}, set(), {5}, set()]  # BOS alone: no context matches
    assert _banned(both, [[6], [9], [8], [8]]) == [{5, 7}, {10}, {5}, set()]  # shorter than the contexts


def _other(*tokens: int) -> int:
    """The first ordinary token (4 ..) that is none of `tokens`."""
    return next(t for t in range(4, VOCAB) if t not in tokens)


def _free_phrases(h: list[int]) -> tuple[tuple[int, ...], ...] | None:
    """Avoided phrases of 1, 2 and 3 tokens that hypothesis `h` never contains, but whose earlier tokens
    it produces (so banning those would change it) and whose last tokens it produces after other tokens
    (so banning them out of context would change it); None when `h` is too short for that."""
    if len(h) < 5:
        return None
    phrases = [
        (h[0], h[1], _other(h[2])),  # its first two tokens start the output
        (h[2], _other(h[3])),
        (_other(h[1]), h[2], h[3]),  # its last two tokens are produced, after another one
        (_other(h[3]), h[4]),  # its last token is produced, after another one
    ]
    unused = [t for t in range(4, VOCAB) if t not in h]
    phrases += [(unused[0],)] if unused else []
    return None if any(_contains(h, p) for p in phrases) else tuple(phrases)


@pytest.mark.parametrize(
    "settings",
    [{"beam_size": 1}, {"search": "sample", "n_best": 3, "top_k": 5}],
    ids=["greedy", "sample"],
)
def test_avoiding_phrases_an_output_lacks_leaves_it_unchanged(settings: dict) -> None:
    """Greedy search and sampling (the same draws) choose among the tokens left: where an output holds
    none of the avoided phrases (but their first tokens, and their last ones after other tokens), adding
    them changes no token and no score."""
    model, src = _model(), tiny_sources(BATCH, vocab=VOCAB)
    decoding = DecodingSettings(max_len_b=20, **settings)
    plain = search(model, src, decoding, torch.Generator().manual_seed(5))
    requests = [_free_phrases(_tokens(plain[0][b, 0])) for b in range(BATCH)]
    requests = [TargetRequest(avoid=r) if r is not None else TargetRequest() for r in requests]
    for b, request in enumerate(requests):  # every sample of the sentence must lack them
        for k in range(1, plain[0].shape[1]):
            if any(_contains(_tokens(plain[0][b, k]), p) for p in request.avoid):
                requests[b] = TargetRequest()
    assert sum(bool(r) for r in requests) >= BATCH // 2  # enough outputs to test
    avoided = search(model, src, decoding, torch.Generator().manual_seed(5), requests)
    assert torch.equal(plain[0], avoided[0]) and torch.equal(plain[1], avoided[1])


def test_a_limit_that_the_request_fills_exactly_is_satisfiable() -> None:
    """prefix (1) + phrases (3) + EOS = 5 tokens: a limit of 5 is satisfiable and the search fills it
    with every phrase; a limit of 4 (one token less) is not."""
    model, src = _model(eos_boost=9.0), tiny_sources(4, vocab=VOCAB)
    requests = [TargetRequest(prefix=(7,), include=((5, 6), (8,)))] * 4
    assert requests[0].needed == 5
    for limit, flagged in ((5, []), (4, [0, 1, 2, 3]), (6, [])):
        limits = LengthLimits.of(model.config, src, 0.0, limit).per_sentence.tolist()
        assert limits == [limit] * 4 and unsatisfiable(requests, limits) == flagged, limit
    for beam in (1, 4):
        tokens = search(
            model, src, DecodingSettings(beam_size=beam, max_len_a=0.0, max_len_b=5), None, requests
        )
        for row in tokens[0][:, 0]:
            hypothesis = _tokens(row)
            assert len(hypothesis) == 4 and hypothesis[0] == 7, hypothesis  # the limit, EOS included
            assert _contains(hypothesis, (5, 6)) and 8 in hypothesis, hypothesis


@pytest.mark.parametrize("eos_boost", [0.0, 9.0])
def test_dynamic_beam_allocation_proposes_and_keeps_each_extension_once(
    monkeypatch: pytest.MonkeyPatch, eos_boost: float
) -> None:
    """Under required phrases no step proposes a (parent beam, token) pair twice (a phrase's next token
    among the parent's top tokens, or two phrases wanting the same token), no step keeps one twice, and
    the n-best entries of a sentence are pairwise distinct."""
    proposed: list[Tensor] = []

    def candidates(state: ConstraintState, log_probs: Tensor, scores: Tensor, per_beam: int):
        cand_scores, tokens, parents = original(state, log_probs, scores, per_beam)  # each (n, M)
        proposed.append(torch.stack([cand_scores, tokens.float(), parents.float()], dim=-1))
        return cand_scores, tokens, parents

    kept: list[tuple[Tensor, Tensor]] = []

    def survivors(state: ConstraintState, cand_scores: Tensor, cand_tokens: Tensor, *args: object):
        pick, new_tokens, new_scores = original_survivors(state, cand_scores, cand_tokens, *args)
        parents = proposed[-1][..., 2].gather(1, pick)  # (n, K)
        kept.append((torch.stack([parents, new_tokens.float()], dim=-1), torch.isfinite(new_scores)))
        return pick, new_tokens, new_scores

    original, original_survivors = ConstraintState.candidates, ConstraintState.survivors
    monkeypatch.setattr(ConstraintState, "candidates", candidates)
    monkeypatch.setattr(ConstraintState, "survivors", survivors)
    model, src = _model(eos_boost=eos_boost), tiny_sources(BATCH, vocab=VOCAB)
    generator = torch.Generator().manual_seed(11)
    requests = []
    for _ in range(BATCH):  # phrases sharing tokens, so two phrases often want the same next token
        start = int(torch.randint(4, 8, (1,), generator=generator))
        requests.append(TargetRequest(include=((start, start + 1), (start,), (start + 1, start + 2, start))))
    tokens, scores = search(model, src, DecodingSettings(beam_size=6, n_best=6, max_len_b=16), None, requests)
    assert len(proposed) > 5
    for step in proposed:
        for sentence in step:  # (M, 3): score, token, parent
            live = sentence[torch.isfinite(sentence[:, 0])]
            pairs = [(int(p), int(t)) for _, t, p in live.tolist()]
            assert len(pairs) == len(set(pairs)), pairs
    for step, alive in kept:
        for sentence, finite in zip(step, alive):  # (K, 2): parent, token; (K,)
            pairs = [tuple(pair) for pair in sentence[finite].tolist()]
            assert len(pairs) == len(set(pairs)), pairs
    for b in range(BATCH):
        ended = [tuple(_tokens(tokens[b, k])) for k in range(tokens.shape[1]) if torch.isfinite(scores[b, k])]
        assert len(ended) == len(set(ended)) and len(ended) > 1, ended
