"""Greedy and beam search: a trained tiny model reverses its inputs, KV-cached search equals naive
recomputation, results do not depend on batch size or padding, scores follow the length penalty."""

import inspect
import itertools

import pytest
import torch
from torch import nn

from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer
from transformer.search.decoding import DecodingSettings, beam_search, greedy_search, sample, search

PAD, BOS, EOS = 0, 1, 2
VOCAB = 14  # 4 specials (pad, bos, eos, unk) + 10 symbols


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


def _reverse_task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """src = [BOS x EOS], tgt_in = [BOS reversed(x)], tgt_out = [reversed(x) EOS], right-padded."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.full((n, 10), PAD)
    tgt_in, tgt_out = torch.full((n, 9), PAD), torch.full((n, 9), PAD)
    for row in range(n):
        length = int(torch.randint(2, 9, (1,), generator=generator))
        x = torch.randint(4, VOCAB, (length,), generator=generator)
        src[row, : length + 2] = torch.cat([torch.tensor([BOS]), x, torch.tensor([EOS])])
        tgt_in[row, : length + 1] = torch.cat([torch.tensor([BOS]), x.flip(0)])
        tgt_out[row, : length + 1] = torch.cat([x.flip(0), torch.tensor([EOS])])
    return src, tgt_in, tgt_out


def _tiny_config(**overrides: object) -> TransformerConfig:
    values: dict[str, object] = {
        "src_vocab_size": VOCAB,
        "d_model": 32,
        "n_heads": 4,
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "d_ff": 64,
        "dropout": 0.0,
        "max_len": 32,
    }
    values.update(overrides)
    return TransformerConfig(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reverser() -> tuple[Seq2SeqTransformer, torch.Tensor, torch.Tensor]:
    """A tiny post-LN model trained (about 2 s) until it reverses its 32 training sequences."""
    torch.manual_seed(0)
    src, tgt_in, tgt_out = _reverse_task(32, seed=0)
    model = Seq2SeqTransformer(_tiny_config())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
    for _ in range(100):
        logits = model(src, tgt_in)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tgt_out.reshape(-1), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), src, tgt_out


def _random_model(**overrides: object) -> Seq2SeqTransformer:
    """An untrained model whose outputs vary from step to step (scaled-up logits)."""
    torch.manual_seed(1)
    model = Seq2SeqTransformer(_tiny_config(**overrides)).eval()
    with torch.no_grad():
        model.output_projection.weight.mul_(4.0)
    return model


def _padded_to(hypotheses: torch.Tensor, width: int) -> torch.Tensor:
    return nn.functional.pad(hypotheses, (0, width - hypotheses.size(-1)), value=PAD)


def test_tiny_model_learns_to_reverse(
    reverser: tuple[Seq2SeqTransformer, torch.Tensor, torch.Tensor],
) -> None:
    model, src, tgt_out = reverser
    greedy = greedy_search(model, src)
    assert torch.equal(_padded_to(greedy, 9), tgt_out)  # 100% exact, EOS included, then padding
    beams, scores = beam_search(model, src, beam_size=4, n_best=2)
    assert torch.equal(_padded_to(beams[:, 0], 9), tgt_out)
    assert torch.all(scores[:, 0] >= scores[:, 1])
    assert not model.training  # decoding restores the training flag...
    model.train()
    greedy_search(model, src[:2])
    assert model.training  # ...whichever it was
    model.eval()


def _naive_greedy(model: Seq2SeqTransformer, src_row: torch.Tensor, max_length: int) -> list[int]:
    """One sentence, no cache, no batching: the decoder is recomputed over the whole prefix."""
    tgt_in = torch.tensor([[BOS]])
    output: list[int] = []
    for step in range(max_length):
        log_probs = model(src_row[None], tgt_in)[0, -1].log_softmax(-1)
        log_probs[[PAD, BOS]] = -float("inf")
        token = EOS if step == max_length - 1 else int(log_probs.argmax())
        output.append(token)
        if token == EOS:
            break
        tgt_in = torch.cat([tgt_in, torch.tensor([[token]])], dim=1)
    return output


MODELS = {
    "post-LN sinusoidal": {},
    "pre-LN rope": {"norm_first": True, "positional": "rope"},
    "learned swiglu": {"positional": "learned", "activation": "swiglu"},
}


@pytest.mark.parametrize("overrides", MODELS.values(), ids=MODELS.keys())
def test_greedy_equals_uncached_recomputation_per_sentence(overrides: dict[str, object]) -> None:
    model = _random_model(**overrides)
    src, _, _ = _reverse_task(12, seed=1)
    hypotheses = greedy_search(model, src, max_len_a=1.0, max_len_b=2)
    lengths = set()
    for row in range(src.size(0)):
        src_len = int(src[row].ne(PAD).sum())
        with torch.no_grad():
            expected = _naive_greedy(model, src[row, :src_len], max_length=src_len + 2)
        assert hypotheses[row, : len(expected)].tolist() == expected
        assert torch.all(hypotheses[row, len(expected) :] == PAD)  # per-sentence stop, then padding
        lengths.add(len(expected))
    assert len(lengths) > 1  # sentences did end at different steps


@pytest.mark.parametrize("overrides", MODELS.values(), ids=MODELS.keys())
def test_beam_of_one_is_greedy(overrides: dict[str, object]) -> None:
    model = _random_model(**overrides)
    src, _, _ = _reverse_task(32, seed=2)
    greedy = greedy_search(model, src)
    beams, scores = beam_search(model, src, beam_size=1)
    assert beams.shape[:2] == (32, 1) and scores.shape == (32, 1)
    assert torch.equal(beams[:, 0], greedy)


@pytest.mark.parametrize("overrides", MODELS.values(), ids=MODELS.keys())
def test_batch_of_one_and_extra_padding_give_identical_hypotheses(overrides: dict[str, object]) -> None:
    model = _random_model(**overrides)
    src, _, _ = _reverse_task(32, seed=3)
    padded_src = nn.functional.pad(src, (0, 7), value=PAD)
    greedy = greedy_search(model, src)
    beams, scores = beam_search(model, src, beam_size=3, n_best=3)
    assert torch.equal(greedy_search(model, padded_src), greedy)
    padded_beams, padded_scores = beam_search(model, padded_src, beam_size=3, n_best=3)
    assert torch.equal(padded_beams, beams)
    torch.testing.assert_close(padded_scores, scores)
    for row in (0, 5, 17, 31):
        single = src[row : row + 1]
        one = greedy_search(model, single)
        assert torch.equal(_padded_to(one, greedy.size(1))[0], greedy[row])
        one_beams, one_scores = beam_search(model, single, beam_size=3, n_best=3)
        assert torch.equal(_padded_to(one_beams, beams.size(2))[0], beams[row])
        torch.testing.assert_close(one_scores[0], scores[row])


def test_max_length_is_per_sentence_and_ends_with_eos(
    reverser: tuple[Seq2SeqTransformer, torch.Tensor, torch.Tensor],
) -> None:
    """The reverser wants len(x) + 1 tokens; a limit of floor(0.5 * (len(x) + 2) + 1) cuts most short."""
    model, src, tgt_out = reverser
    limits = (0.5 * src.ne(PAD).sum(1) + 1).floor().long()
    greedy = greedy_search(model, src, max_len_a=0.5, max_len_b=1)
    beams, _ = beam_search(model, src, beam_size=3, n_best=3, max_len_a=0.5, max_len_b=1)
    for row in range(src.size(0)):
        limit = int(limits[row])
        for k, hypothesis in enumerate([greedy[row], *beams[row]]):
            tokens = hypothesis[hypothesis != PAD].tolist()
            assert tokens[-1] == EOS and EOS not in tokens[:-1] and len(tokens) <= limit
            assert torch.all(hypothesis[len(tokens) :] == PAD)
            if k == 0:  # greedy: the reversal, cut at the limit (beams may trade it for a likelier EOS)
                assert tokens[:-1] == tgt_out[row, : limit - 1].tolist()
                assert len(tokens) == limit


def _log_prob(model: Seq2SeqTransformer, src: torch.Tensor, tokens: list[int]) -> float:
    """Sum of log-probabilities of `tokens` (ending with EOS) by one full forward pass."""
    tgt_in = torch.tensor([[BOS, *tokens[:-1]]])
    with torch.no_grad():
        log_probs = model(src[None], tgt_in)[0].log_softmax(-1)  # (T, V)
    return float(log_probs.gather(1, torch.tensor(tokens)[:, None]).sum())


# the length normalizations of `decode.length_normalization`, as plain math: len counts EOS
NORMALIZATIONS = {"gnmt": lambda n, alpha: ((5 + n) / 6) ** alpha, "power": lambda n, alpha: n**alpha}


@pytest.mark.parametrize("form", ["gnmt", "power"])
def test_wide_beam_is_exhaustive_search_with_length_penalty(form: str) -> None:
    """With 4 ordinary tokens and max length 3, a 32-wide beam scores all 21 hypotheses exactly, under
    either normalization (whose rankings differ here: the other formula's would fail)."""
    config = _tiny_config(src_vocab_size=7, max_len=8)
    torch.manual_seed(2)
    model = Seq2SeqTransformer(config).eval()
    with torch.no_grad():
        model.output_projection.weight.mul_(3.0)
    src = torch.tensor([[BOS, 4, 5, 6, EOS], [BOS, 6, EOS, PAD, PAD]])
    alpha = 1.0  # the two formulas rank both sentences' hypotheses differently
    beams, scores = beam_search(
        model, src, beam_size=32, length_penalty=alpha, length_normalization=form, max_len_a=0, max_len_b=3,
        n_best=5,
    )  # fmt: skip
    for row in range(2):
        candidates = [[EOS]] + [
            [*prefix, EOS] for n in (1, 2) for prefix in itertools.product(range(3, 7), repeat=n)
        ]
        assert len(candidates) == 21
        log_probs = [_log_prob(model, src[row], c) for c in candidates]
        ranked, other = (
            sorted(((lp / norm(len(c), alpha), c) for lp, c in zip(log_probs, candidates)), reverse=True)
            for norm in (NORMALIZATIONS[form], NORMALIZATIONS["power" if form == "gnmt" else "gnmt"])
        )
        assert [c for _, c in ranked[:5]] != [c for _, c in other[:5]]  # the formula decides the list
        for k in range(5):
            expected_score, expected_tokens = ranked[k]
            assert beams[row, k][beams[row, k] != PAD].tolist() == expected_tokens
            assert scores[row, k].item() == pytest.approx(expected_score, abs=1e-4)


@pytest.mark.parametrize("form", ["gnmt", "power"])
@pytest.mark.parametrize("search_kind", ["greedy", "sample"])
def test_one_row_searches_score_with_the_length_normalization(form: str, search_kind: str) -> None:
    """Greedy search and sampling (one hypothesis per row, the normalizer over a tensor of lengths) score
    a hypothesis as its summed log-probability / the formula at its length, EOS counted."""
    model = _random_model()
    src = torch.tensor([[BOS, 4, 5, 6, 7, EOS], [BOS, 8, EOS, PAD, PAD, PAD]])
    settings = DecodingSettings(
        search=search_kind, length_penalty=1.3, length_normalization=form, max_len_a=0, max_len_b=6
    )
    tokens, scores = search(model, src, settings, torch.Generator().manual_seed(0))
    lengths = set()
    for row in range(2):
        hypothesis = tokens[row, 0][tokens[row, 0] != PAD].tolist()
        lengths.add(len(hypothesis))
        expected = _log_prob(model, src[row], hypothesis) / NORMALIZATIONS[form](len(hypothesis), 1.3)
        assert scores[row, 0].item() == pytest.approx(expected, abs=1e-4)
    assert lengths != {1}  # not only EOS: the length matters


def test_bad_arguments_raise() -> None:
    model = _random_model()
    src = torch.tensor([[BOS, 4, EOS]])
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(model, src, beam_size=0)
    with pytest.raises(ValueError, match="n_best"):
        beam_search(model, src, beam_size=2, n_best=3)
    with pytest.raises(ValueError, match="max_len_a"):
        greedy_search(model, src, max_len_a=-1.0)
    with pytest.raises(ValueError, match=r"length_normalization must be one of \['gnmt', 'power'\], got 'x'"):
        beam_search(model, src, beam_size=2, length_normalization="x")


def test_empty_batch() -> None:
    model = _random_model()
    src = torch.zeros(0, 5, dtype=torch.long)
    assert greedy_search(model, src).shape == (0, 0)
    hypotheses, scores = beam_search(model, src, beam_size=2, n_best=2)
    assert hypotheses.shape == (0, 2, 0) and scores.shape == (0, 2)


@pytest.mark.parametrize("wrapper", [greedy_search, sample, beam_search])
def test_the_wrappers_defaults_are_the_settings_defaults(wrapper: object) -> None:
    """Each keyword of greedy_search / sample / beam_search that names a DecodingSettings field defaults
    to that field's default (beam_search's beam_size excepted: 4, a beam search's own), so that the two
    cannot drift apart."""
    defaults = DecodingSettings()
    keywords = {
        name: parameter.default
        for name, parameter in inspect.signature(wrapper).parameters.items()
        if name in DecodingSettings.__dataclass_fields__
    }
    assert keywords, "every wrapper takes some of the settings"
    expected = {name: getattr(defaults, name) for name in keywords}
    if wrapper is beam_search:
        expected["beam_size"] = 4
    assert keywords == expected
