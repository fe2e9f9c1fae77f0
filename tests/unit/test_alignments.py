"""Word alignments: the attention they come from is the search's own (causal: a later token never
changes an earlier position's weights; equal to the cross-attention the cached step computed for each
token), subwords are joined into the whitespace words a user sees, and each output word gets exactly one
pair with indices inside both lines."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny import tiny_seq2seq, tiny_sources
from transformer.cli.word_alignments import Aligner, pharaoh, piece_function, word_index
from transformer.search.alignments import cross_attention, word_alignment
from transformer.search.decoding import DecodingSettings, search
from transformer.search.ensemble import Ensemble

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 24


class _Pieces:
    """A stand-in for a `tokenizers.Tokenizer`: even ids start a word ("▁a4"), odd ids continue one."""

    def id_to_token(self, i: int) -> str:
        return f"▁a{i}" if i % 2 == 0 else f"b{i}"


class _Tokenizer:
    tokenizer = _Pieces()


def _text(ids: list[int]) -> str:
    """What the tokenizer's decoder shows for `ids` (specials dropped)."""
    pieces = [_Pieces().id_to_token(i) for i in ids if i > 3]
    return "".join(pieces).replace("▁", " ").strip()


def test_word_index_joins_subwords() -> None:
    assert word_index(["▁Das", "▁Haus", "boot", None, "▁ist", ".", None]) == [0, 1, 1, -1, 2, 2, -1]
    assert word_index(["ab", "▁c"]) == [0, 1]  # a first piece starts a word even without the mark


def test_word_alignment_sums_subword_attention_into_words() -> None:
    attention = torch.tensor(
        [  # target tokens x source tokens (BOS, w0, w1a, w1b, EOS)
            [0.82, 0.06, 0.04, 0.04, 0.04],  # t0 (word 0): w1's two pieces (0.08) beat w0's one (0.06)
            [0.0, 0.6, 0.1, 0.3, 0.0],  # t1 (word 1, first piece): alone it would take w0 ...
            [0.0, 0.1, 0.45, 0.45, 0.0],  # t2 (word 1, second piece): ... with it, w1 (1.3 vs 0.7)
            [0.0, 0.0, 0.0, 0.0, 1.0],  # EOS: no word
        ]
    )
    pairs = word_alignment(attention, [-1, 0, 1, 1, -1], [0, 1, 1, -1])
    assert pairs == [(1, 0), (1, 1)]
    assert word_alignment(attention[:2], [-1, 0, 1, 1, -1], [0, 1]) == [(1, 0), (0, 1)]
    assert (
        pharaoh(pairs, 2, 2) == "1-0 1-1" and pharaoh([(5, 7)], 2, 3) == "1-2" and pharaoh(pairs, 0, 2) == ""
    )


def test_the_attention_is_the_searchs_own() -> None:
    """Each position's weights depend only on the tokens before it, so the teacher-forced pass gives
    what the search's step saw when it produced the token."""
    model, src = tiny_seq2seq(0, vocab=VOCAB, layers=3), tiny_sources(4, vocab=VOCAB)
    tokens = search(model, src, DecodingSettings(max_len_b=8))[0][:, 0]  # (B, L)
    full = cross_attention(model, src, tokens, -2)  # (B, L, S)
    assert full.shape == (*tokens.shape, src.shape[1])
    assert torch.allclose(full.sum(-1), torch.ones(tokens.shape))  # a distribution over the source
    for t in range(1, tokens.shape[1]):
        prefix = cross_attention(model, src, tokens[:, :t], -2)
        assert torch.allclose(prefix, full[:, :t], atol=1e-5)
    assert not torch.allclose(full, cross_attention(model, src, tokens, -1))  # the layer is chosen
    with pytest.raises(ValueError, match="alignment_layer=3"):
        cross_attention(model, src, tokens, 3)


@pytest.mark.parametrize("ensemble", [False, True])
def test_alignment_lines_have_one_pair_per_output_word_in_range(ensemble: bool) -> None:
    model = tiny_seq2seq(0, vocab=VOCAB)
    if ensemble:
        model = Ensemble([model, tiny_seq2seq(1, vocab=VOCAB, d_model=16, layers=1)])
    src = tiny_sources(8, vocab=VOCAB)
    tokens, _ = search(model, src, DecodingSettings(beam_size=4, n_best=3, max_len_b=6))
    piece = piece_function(_Tokenizer(), {0, 1, 2})
    sources = [_text(row) for row in src.tolist()]
    outputs = [[_text(row) for row in sentence] for sentence in tokens.tolist()]
    lines = Aligner(model, -2, piece, piece).lines(src, tokens, sources, outputs)
    checked = 0
    for b, sentence in enumerate(lines):
        assert len(sentence) == len(outputs[b])
        for k, line in enumerate(sentence):
            pairs = [tuple(map(int, pair.split("-"))) for pair in line.split()]
            n_src, n_tgt = len(sources[b].split()), len(outputs[b][k].split())
            assert sorted(j for _, j in pairs) == list(range(n_tgt)), (line, outputs[b][k])
            assert all(0 <= i < n_src for i, _ in pairs)
            checked += n_tgt
    assert checked > 20


@pytest.mark.parametrize("layer", [-2, -1, 0])
def test_the_attention_equals_the_cached_steps_cross_attention(
    monkeypatch: pytest.MonkeyPatch, layer: int
) -> None:
    """The weights `cross_attention` returns for each produced token (EOS included) are the ones the
    search's cached step computed when it produced that token: the decoder layer's cross-attention at
    that step, recorded during greedy search, averaged over heads."""
    model, src = tiny_seq2seq(0, vocab=VOCAB, layers=3), tiny_sources(4, vocab=VOCAB)
    attention = model.decoder.layers[layer].cross_attn
    forward, steps = attention.forward, []

    def recording(*args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
        if kwargs.get("kv_cache") is None:  # not the cached step (the teacher-forced pass)
            return forward(*args, **kwargs)
        out, weights = forward(*args, **{**kwargs, "need_weights": True, "average_attn_weights": False})
        steps.append(weights.float().mean(dim=1)[:, -1])  # (rows, H, 1, S) -> (rows, S)
        return out, None

    monkeypatch.setattr(attention, "forward", recording)
    checked = 0
    for b in range(src.shape[0]):  # one sentence at a time: each step's row is this sentence's
        steps.clear()
        tokens = search(model, src[b : b + 1], DecodingSettings(max_len_b=8))[0][:, 0]  # (1, L)
        assert len(steps) == tokens.shape[1] and tokens[0, -1] == 2  # one step per token, EOS last
        aligned = cross_attention(model, src[b : b + 1], tokens, layer)[0]  # (L, S)
        torch.testing.assert_close(aligned, torch.cat(steps), rtol=1e-5, atol=1e-6)
        checked += tokens.shape[1]
    assert checked > 10
