"""TransformerConfig: paper defaults, validation messages that name the field and value."""

import pytest

from transformer.config import TransformerConfig


def test_defaults_are_the_papers_base_model() -> None:
    config = TransformerConfig(src_vocab_size=37000)
    assert (config.d_model, config.n_heads, config.d_ff) == (512, 8, 2048)
    assert (config.n_encoder_layers, config.n_decoder_layers) == (6, 6)
    assert config.dropout == 0.1 and config.norm_first is False
    assert config.positional == "sinusoidal" and config.activation == "relu"
    assert config.tie_embeddings == "all" and config.tgt_vocab_size == 37000
    assert (config.pad_id, config.bos_id, config.eos_id) == (0, 1, 2)
    assert config.d_head == 64


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"d_model": 30, "n_heads": 4}, ["d_model", "30", "n_heads", "4"]),
        ({"activation": "tanh"}, ["activation", "'tanh'"]),
        ({"dropout": -0.1}, ["dropout", "-0.1"]),
        ({"attention_dropout": 1.0}, ["attention_dropout", "1.0"]),
        ({"positional": "alibi"}, ["positional", "'alibi'"]),
        ({"tie_embeddings": "some"}, ["tie_embeddings", "'some'"]),
        ({"embedding_init": "uniform"}, ["embedding_init", "'uniform'"]),
        ({"n_encoder_layers": 0}, ["n_encoder_layers", "0"]),
        ({"d_ff": 2.5}, ["d_ff", "2.5"]),
        ({"max_len": 1}, ["max_len", "1"]),
        ({"tgt_vocab_size": 50, "tie_embeddings": "all"}, ["tie_embeddings", "src_vocab_size", "50"]),
        ({"pad_id": 100}, ["pad_id", "100"]),
        ({"eos_id": 0}, ["eos_id", "pad_id"]),
        ({"eos_id": 1}, ["eos_id", "bos_id"]),
        ({"output_bias": "yes"}, ["output_bias", "'yes'"]),
        ({"norm_first": "yes"}, ["norm_first", "'yes'"]),
        ({"d_model": 24, "n_heads": 8, "positional": "rope"}, ["rope", "3"]),
    ],
)
def test_bad_values_raise_value_error_naming_field_and_value(
    overrides: dict[str, object], fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as error:
        TransformerConfig(src_vocab_size=64, **overrides)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_the_decoder_may_start_from_the_pad_token() -> None:
    """Marian's (OPUS-MT's) convention: no BOS, the decoder's first input is the pad token."""
    config = TransformerConfig(src_vocab_size=64, pad_id=63, bos_id=63, eos_id=0)
    assert config.bos_id == config.pad_id == 63


def test_separate_vocabularies_with_decoder_tying_are_fine() -> None:
    config = TransformerConfig(src_vocab_size=64, tgt_vocab_size=50, tie_embeddings="decoder")
    assert config.tgt_vocab_size == 50


def test_dict_round_trip_and_unknown_keys() -> None:
    config = TransformerConfig(src_vocab_size=64, d_model=32, n_heads=4, positional="rope")
    assert TransformerConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="d_modle"):
        TransformerConfig.from_dict({"src_vocab_size": 64, "d_modle": 32})
