"""Importing transformers' MarianMTModel (the OPUS-MT layout) into ours
(`transformer.interop.marian.from_marian`).

The Marian model is shaped like an OPUS-MT one, only tiny: SiLU ("swish") feed-forward, a
`final_logits_bias`, one shared vocabulary with the pad token last, EOS = 0, the decoder starting from the
pad token, scaled embeddings. Its weights come from a tiny model trained here for a few seconds on a
reversal task (random weights repeat one token until the length limit, which says little about a search),
written into a MarianMTModel built from a literal config. The imported model must compute what
transformers computes (logits within 1e-5 in float32) and search what `generate` searches (greedy token
for token, beam 4 ranked by summed log-probability token for token), on 200 sentences.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers.tiny import tiny_seq2seq  # noqa: E402
from transformer.interop.marian import (  # noqa: E402
    MARIAN_BUFFERS,
    _marian_state_dict,
    from_marian,
    marian_weights,
)
from transformer.interop.source import ExportError  # noqa: E402
from transformer.losses import label_smoothed_cross_entropy  # noqa: E402
from transformer.search.decoding import beam_search, greedy_search  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, PAD, EOS = 40, 39, 0  # OPUS-MT: </s> = 0, <pad> = the last id and the decoder's start


def _opus_mt_config(**changes: object) -> transformers.MarianConfig:
    """A MarianConfig as OPUS-MT's config.json has it, at a tiny size."""
    values = {
        "vocab_size": VOCAB, "decoder_vocab_size": VOCAB, "d_model": 32, "encoder_layers": 2,
        "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
        "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "activation_function": "swish",
        "pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": EOS, "decoder_start_token_id": PAD,
        "forced_eos_token_id": EOS, "max_position_embeddings": 64, "scale_embedding": True,
        "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
        "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
    }  # fmt: skip
    return transformers.MarianConfig(**{**values, **changes})


def _reversal_batch(generator: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """src (n, 10): 1-8 words, EOS, pads (Marian's source layout, no BOS); tgt (n, 10): PAD (the start),
    the words reversed, EOS, pads."""
    src, tgt = torch.full((n, 10), PAD), torch.full((n, 10), PAD)
    for row in range(n):
        length = int(torch.randint(1, 9, (1,), generator=generator))
        words = torch.randint(1, PAD, (length,), generator=generator)
        src[row, :length], src[row, length] = words, EOS
        tgt[row, 1 : length + 1], tgt[row, length + 1] = words.flip(0), EOS
    return src, tgt


@pytest.fixture(scope="module")
def marian() -> transformers.MarianMTModel:
    """An OPUS-MT-shaped MarianMTModel holding weights trained for ~100 steps (seconds) to reverse words."""
    with torch.random.fork_rng():
        opus_mt = {"activation": "silu", "output_bias": True, "pad_id": PAD, "bos_id": PAD, "eos_id": EOS}
        model = tiny_seq2seq(3, vocab=VOCAB, peaked=1.0, **opus_mt).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(0)
        for _ in range(120):
            src, tgt = _reversal_batch(generator, 64)
            loss = label_smoothed_cross_entropy(model(src, tgt[:, :-1]), tgt[:, 1:], ignore_index=PAD).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    marian = transformers.MarianMTModel(_opus_mt_config()).eval()
    weights = marian_weights(model.config, model.state_dict())
    missing, unexpected = marian.load_state_dict(weights, strict=False)
    assert set(missing) == set(MARIAN_BUFFERS) and not unexpected
    return marian


@pytest.fixture(scope="module")
def sources() -> torch.Tensor:
    return _reversal_batch(torch.Generator().manual_seed(5), 200)[0]  # (200, 10)


def _until_eos(rows: torch.Tensor) -> list[list[int]]:
    return [row[: row.index(EOS) + 1] if EOS in row else row for row in rows.tolist()]


def test_imported_config_is_opus_mt_s() -> None:
    model = from_marian(transformers.MarianMTModel(_opus_mt_config()))
    config = model.config
    assert (config.activation, config.output_bias, config.tie_embeddings) == ("silu", True, "all")
    assert (config.pad_id, config.bos_id, config.eos_id) == (PAD, PAD, EOS)  # the decoder starts from pad
    assert (config.norm_first, config.positional, config.max_len) == (False, "sinusoidal", 64)
    assert not model.training


def test_imported_logits_equal_transformers_on_a_padded_batch(marian, sources) -> None:
    ours = from_marian(marian)
    src = sources[:32]
    tgt = torch.cat([torch.full((32, 1), PAD), torch.randint(1, PAD, (32, 7))], dim=1)  # PAD = the start
    with torch.no_grad():
        theirs = marian(input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt).logits
        mine = ours(src, tgt)
    assert src.eq(PAD).any()  # padded sources: the mask must come from the pad id
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_imported_greedy_search_equals_generate(marian, sources) -> None:
    ours = greedy_search(from_marian(marian), sources, max_len_a=0, max_len_b=20)
    # OPUS-MT's generation_config.json bans the pad token (bad_words_ids); ours never emits it either
    theirs = marian.generate(
        input_ids=sources, attention_mask=sources.ne(PAD), num_beams=1, max_new_tokens=20,
        do_sample=False, bad_words_ids=[[PAD]],
    )  # fmt: skip
    assert theirs[:, 0].eq(PAD).all()  # both decoders start from the pad token
    hypotheses = _until_eos(ours)
    assert hypotheses == _until_eos(theirs[:, 1:])
    assert len({len(h) for h in hypotheses}) >= 8 and all(h[-1] == EOS for h in hypotheses)  # real endings


def test_imported_beam_search_equals_generate(marian, sources) -> None:
    """Beam 4 with length_penalty 0 (both rank by the summed log-probability): every sentence the same;
    with 0.6 the two length normalisations differ (GNMT's against len ** alpha): most sentences agree."""
    model = from_marian(marian)
    for alpha, required in ((0.0, 1.0), (0.6, 0.85)):
        ours, _ = beam_search(model, sources, beam_size=4, length_penalty=alpha, max_len_a=0, max_len_b=20)
        theirs = marian.generate(
            input_ids=sources, attention_mask=sources.ne(PAD), num_beams=4, max_new_tokens=20,
            do_sample=False, length_penalty=alpha, bad_words_ids=[[PAD]],
        )  # fmt: skip
        pairs = list(zip(_until_eos(ours[:, 0]), _until_eos(theirs[:, 1:])))
        assert sum(a == b for a, b in pairs) / len(pairs) >= required, alpha


def test_import_then_export_gives_back_the_same_weights(marian) -> None:
    """One mapping, two directions: Marian -> ours -> Marian is the identity on every weight."""
    exported = _marian_state_dict(from_marian(marian))
    original = {k: v for k, v in marian.state_dict().items() if k not in MARIAN_BUFFERS}
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize(
    ("changes", "tie"),
    [
        ({"share_encoder_decoder_embeddings": False, "tie_word_embeddings": False}, "none"),
        ({"share_encoder_decoder_embeddings": False, "decoder_vocab_size": 45}, "decoder"),
        ({"activation_function": "relu"}, "all"),
        ({"activation_function": "gelu"}, "all"),
        ({"scale_embedding": False}, "all"),
    ],
    ids=["untied", "separate-target-vocabulary", "relu", "gelu", "unscaled"],
)
def test_other_marian_layouts_import_exactly(changes: dict, tie: str) -> None:
    """Random weights (transformers' init, then every weight and the logits bias redrawn): the logits
    equal; untied and separate vocabularies map to our tie_embeddings none / decoder."""
    torch.manual_seed(0)
    marian = transformers.MarianMTModel(_opus_mt_config(**changes)).eval()
    with torch.no_grad():
        for name, parameter in marian.named_parameters():
            if "embed_positions" not in name:  # the sinusoid tables Marian rebuilds itself
                parameter.normal_(0.0, 0.3)
        marian.final_logits_bias.normal_()
    ours = from_marian(marian)
    assert ours.config.tie_embeddings == tie
    assert ours.config.scale_embedding == marian.config.scale_embedding
    src = torch.tensor([[5, 6, 7, EOS, PAD], [8, 9, 10, 11, EOS]])
    tgt = torch.tensor([[PAD, 3, 4, 5], [PAD, 9, 2, 1]])
    with torch.no_grad():
        theirs = marian(input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt).logits
        torch.testing.assert_close(ours(src, tgt), theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (lambda: transformers.BartConfig(vocab_size=40), "model_type='bart'"),
        (
            lambda: _opus_mt_config(decoder_attention_heads=2),
            "encoder_attention_heads=4 but decoder_attention_heads=2",
        ),
        (lambda: _opus_mt_config(encoder_ffn_dim=48), "encoder_ffn_dim=48 but decoder_ffn_dim=64"),
        (lambda: _opus_mt_config(activation_function="gelu_new"), "activation_function='gelu_new'"),
        (lambda: _opus_mt_config(decoder_start_token_id=7), "decoder_start_token_id=7"),
        (lambda: _opus_mt_config(eos_token_id=PAD), "eos_token_id equals the pad"),
        (
            lambda: _opus_mt_config(tie_word_embeddings=False),
            "share_encoder_decoder_embeddings=true with tie_word_embeddings=false",
        ),
    ],
    ids=["bart", "heads", "ffn", "gelu-new", "start", "eos", "shared-untied"],
)
def test_what_ours_cannot_represent_is_refused_by_name(config, named: str) -> None:
    class Stub:  # from_marian reads the config first: no need to build the (possibly foreign) model
        def __init__(self, config: object) -> None:
            self.config = config

    with pytest.raises(ExportError, match="cannot import this model: ") as refused:
        from_marian(Stub(config()))  # type: ignore[arg-type]
    assert named in str(refused.value)


def test_a_decoder_starting_from_its_bos_token_is_taken_and_an_end_token_equal_to_the_start_refused() -> None:
    """Marian configs may start the decoder from the pad token (OPUS-MT) or from a BOS token of its own;
    ours starts from `bos_id` either way. An EOS equal to the start token (or the pad) has no end."""
    from transformer.interop.marian import config_from_marian, marian_refusal

    opus = config_from_marian(_opus_mt_config())
    assert (opus.pad_id, opus.bos_id, opus.eos_id) == (PAD, PAD, EOS)
    started = _opus_mt_config(bos_token_id=3, decoder_start_token_id=3)
    assert marian_refusal(started) is None
    config = config_from_marian(started)
    assert (config.pad_id, config.bos_id, config.eos_id) == (PAD, 3, EOS)
    for start in (EOS, 3):
        same = _opus_mt_config(bos_token_id=start, decoder_start_token_id=start, eos_token_id=start)
        assert marian_refusal(same) == (
            "eos_token_id equals the pad or decoder start token: ours needs a distinct end token"
        )
    assert "decoder_start_token_id=4 is neither" in marian_refusal(_opus_mt_config(decoder_start_token_id=4))


def test_tied_matrices_that_disagree_and_a_shared_embedding_over_two_vocabularies_are_refused() -> None:
    """Marian holds the shared embedding under three names (shared, encoder's, decoder's): ours keeps one
    matrix, so the copies must be equal; sharing it between vocabularies of two sizes is impossible."""
    from transformer.interop.marian import config_from_marian, marian_refusal, weights_from_marian

    torch.manual_seed(0)
    marian = transformers.MarianMTModel(_opus_mt_config()).eval()
    config = config_from_marian(marian.config)
    weights = {name: tensor.clone() for name, tensor in marian.state_dict().items()}
    assert (
        weights_from_marian(config, weights).keys()
        == tiny_seq2seq(0, vocab=VOCAB, activation="silu", max_len=64, tie_embeddings="all", output_bias=True)
        .state_dict()
        .keys()
    )
    weights["model.encoder.embed_tokens.weight"][3, 0] += 1.0
    with pytest.raises(
        ValueError, match=r"model\.encoder\.embed_tokens\.weight differs from the matrix tied"
    ):
        weights_from_marian(config, weights)
    refusal = marian_refusal(_opus_mt_config(decoder_vocab_size=45))
    assert refusal == "share_encoder_decoder_embeddings=true with vocab_size 40 != decoder_vocab_size 45"
