"""Which decoding settings the CTranslate2 backend takes and which it refuses by name
(`transformer.inference.ctranslate2_options.ctranslate2_refusal`); what it decodes is compared with the torch
backend in tests/integration/test_ctranslate2_backend.py."""

from __future__ import annotations

import pytest

from transformer.inference.ctranslate2_options import ctranslate2_refusal
from transformer.search.decoding import DecodingSettings


@pytest.mark.parametrize(
    "options",
    [
        {},  # greedy, GNMT alpha 0.6: greedy tokens do not depend on alpha, scores are ours
        {"length_penalty": 1.0, "length_normalization": "power", "min_len": 3, "no_repeat_ngram_size": 2},
        {"beam_size": 4, "length_penalty": 0.0},
        {"search": "beam", "beam_size": 1, "length_penalty": 1.0},  # one beam: greedy search's tokens
        {"beam_size": 4, "length_penalty": 0.0, "kv_cache": "static"},  # how ours runs: not CTranslate2's
        {"search": "sample", "n_best": 3, "top_k": 10, "top_p": 0.9, "min_len": 2, "no_repeat_ngram_size": 3},
    ],
)
def test_what_ctranslate2_decodes_as_ours_is_taken(options: dict) -> None:
    assert ctranslate2_refusal(DecodingSettings(**options)) is None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"beam_size": 4}, "length_penalty=0.6 with beam_size=4: CTranslate2's beam search divides by len"),
        ({"beam_size": 2, "length_penalty": -0.5}, "length_penalty=-0.5 with beam_size=2"),
        ({"beam_size": 4, "length_penalty": 0.0, "n_best": 2}, "n_best=2 with beam_size=4"),
        ({"beam_size": 4, "length_penalty": 0.0, "min_len": 1}, "min_len=1 with beam_size=4"),
        ({"beam_size": 4, "length_penalty": 0.0, "no_repeat_ngram_size": 3}, "no_repeat_ngram_size=3 with"),
        ({"temperature": 0.7}, "temperature=0.7"),
        ({"search": "sample", "temperature": 1.5}, "temperature=1.5"),
        ({"alignments": True}, "alignments"),
    ],
)
def test_what_it_would_decode_otherwise_is_refused_by_name(options: dict, named: str) -> None:
    refusal = ctranslate2_refusal(DecodingSettings(**options))
    assert refusal is not None and refusal.startswith(named), refusal
    assert "\n" not in refusal
