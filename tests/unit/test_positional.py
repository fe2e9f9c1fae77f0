"""Positional encodings: the paper's sinusoid formula, offsets, RoPE's relative-position property."""

import math

import pytest
import torch

from transformer.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    build_absolute_positional,
    sinusoidal_table,
)


@pytest.mark.parametrize("d_model", [16, 15])
def test_sinusoidal_matches_the_papers_formula(d_model: int) -> None:
    table = sinusoidal_table(50, d_model)
    for pos in (0, 1, 7, 49):
        for i in range(d_model):
            angle = pos / 10000 ** ((i - i % 2) / d_model)
            expected = math.sin(angle) if i % 2 == 0 else math.cos(angle)
            assert table[pos, i].item() == pytest.approx(expected, abs=1e-6)


def test_sinusoidal_adds_the_table_at_an_offset() -> None:
    encoding = SinusoidalPositionalEncoding(d_model=8, max_len=20)
    x = torch.randn(2, 5, 8)
    full = encoding(torch.zeros(2, 10, 8))
    torch.testing.assert_close(encoding(x, offset=3), x + full[:, 3:8])
    assert not encoding.state_dict()  # derived from the shape: nothing to checkpoint


@pytest.mark.parametrize("module", [SinusoidalPositionalEncoding(8, 10), LearnedPositionalEmbedding(8, 10)])
def test_positions_beyond_max_len_raise(module: torch.nn.Module) -> None:
    module(torch.zeros(1, 10, 8))
    with pytest.raises(ValueError, match="max_len"):
        module(torch.zeros(1, 3, 8), offset=8)


def test_learned_positions_are_trained_parameters_at_an_offset() -> None:
    encoding = LearnedPositionalEmbedding(d_model=4, max_len=6)
    out = encoding(torch.zeros(1, 2, 4), offset=3)
    torch.testing.assert_close(out[0], encoding.embedding.weight[3:5])
    out.sum().backward()
    assert encoding.embedding.weight.grad is not None


def test_rotary_scores_depend_only_on_relative_position() -> None:
    rotary = RotaryEmbedding(d_head=8, max_len=64)
    q, k = torch.randn(2, 1, 1, 8)
    scores = []
    for shift in (0, 5, 30):
        q_rot = rotary(q, offset=10 + shift)  # query at position 10 + shift
        k_rot = rotary(k, offset=3 + shift)  # key at position 3 + shift
        scores.append((q_rot * k_rot).sum())
    torch.testing.assert_close(scores[0], scores[1])
    torch.testing.assert_close(scores[0], scores[2])


def test_rotary_is_a_rotation_and_offset_consistent() -> None:
    rotary = RotaryEmbedding(d_head=8, max_len=16)
    x = torch.randn(2, 3, 6, 8)  # (B, H, L, Dh)
    out = rotary(x)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # rotations keep lengths
    torch.testing.assert_close(out[:, :, :1], x[:, :, :1])  # position 0 is not rotated
    torch.testing.assert_close(rotary(x[:, :, 4:], offset=4), out[:, :, 4:])  # incremental == full
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(d_head=7, max_len=16)


def test_builder_maps_names_to_modules() -> None:
    assert isinstance(build_absolute_positional("sinusoidal", 8, 10), SinusoidalPositionalEncoding)
    assert isinstance(build_absolute_positional("learned", 8, 10), LearnedPositionalEmbedding)
    assert build_absolute_positional("rope", 8, 10) is None
    with pytest.raises(ValueError, match="'alibi'"):
        build_absolute_positional("alibi", 8, 10)
