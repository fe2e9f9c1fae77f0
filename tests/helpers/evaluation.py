"""A fake vocabulary of word ids (V), its detokenizer and a tiny model config for scoring and restoring."""

from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
V = 14  # ids 4..13 are "words"
SHORT = {"beam_size": 1, "length_penalty": 0.6, "max_len_a": 1.0, "max_len_b": 3}


def tiny_config(**overrides: object) -> dict[str, object]:
    """A one-layer model of V words (d_model 16, no dropout), with `overrides`."""
    return {
        "src_vocab_size": V,
        "d_model": 16,
        "n_heads": 2,
        "n_encoder_layers": 1,
        "n_decoder_layers": 1,
        "d_ff": 32,
        "dropout": 0.0,
        "max_len": 32,
        **overrides,
    }


def detokenize(ids: list[int]) -> str:
    """Detokenizer of the fake vocabulary: word ids as numbers, stopping at EOS."""
    words = []
    for i in ids:
        if i == EOS:
            break
        if i > 3:
            words.append(str(i))
    return " ".join(words)


def detokenize_batch(rows: list[list[int]]) -> list[str]:
    """`detokenize` on every row."""
    return [detokenize(row) for row in rows]
