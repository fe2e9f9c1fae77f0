"""Which decoding settings the CTranslate2 backend (`transformer.inference.ctranslate2`) decodes as our
search does, and the one line naming the option for those it refuses (`ctranslate2_refusal`)."""

from __future__ import annotations

from transformer.inference.outputs import InferenceError
from transformer.search.decoding import DecodingSettings

__all__ = ["ctranslate2_checked", "ctranslate2_refusal"]


def ctranslate2_refusal(settings: DecodingSettings) -> str | None:
    """Why CTranslate2 cannot decode as `settings` say exactly (one line naming the option), or None."""
    beam = not settings.sampling and settings.beam_size > 1  # one beam searches as greedy search does
    if settings.alignments:
        return "alignments: translate() gives no word alignments (evaluate.py does)"
    if settings.temperature != 1.0:
        return (
            f"temperature={settings.temperature}: the CTranslate2 backend scores hypotheses at temperature "
            "1 (CTranslate2 applies a temperature to sampling's draws only); use the torch backend"
        )
    if beam and settings.length_penalty != 0:
        return (
            f"length_penalty={settings.length_penalty} with beam_size={settings.beam_size}: CTranslate2's "
            "beam search divides by len ** alpha with len without EOS and stops once beam_size hypotheses "
            f"have ended, which ranks otherwise than this search ({settings.length_normalization}, our "
            "stopping rule); use length_penalty=0, beam_size=1 or the torch backend"
        )
    if beam and settings.n_best > 1:
        return (
            f"n_best={settings.n_best} with beam_size={settings.beam_size}: CTranslate2's beam search stops "
            "once beam_size hypotheses have ended, before the rest of an n-best list is settled (its best "
            "hypothesis is ours at length_penalty 0, its others may not be); use n_best=1 or backend torch"
        )
    if beam and settings.min_len:
        return (
            f"min_len={settings.min_len} with beam_size={settings.beam_size}: CTranslate2 renormalizes the "
            "log-probabilities once EOS is banned, which ranks beams otherwise than ours; use beam_size=1 or "
            "the torch backend"
        )
    if beam and settings.no_repeat_ngram_size:
        return (
            f"no_repeat_ngram_size={settings.no_repeat_ngram_size} with beam_size={settings.beam_size}: "
            "CTranslate2 renormalizes the log-probabilities of a blocked step, which ranks beams otherwise "
            "than ours; use beam_size=1 or the torch backend"
        )
    return None


def ctranslate2_checked(settings: DecodingSettings) -> DecodingSettings:
    """`settings`, or an `InferenceError` with `ctranslate2_refusal`'s line."""
    refusal = ctranslate2_refusal(settings)
    if refusal is not None:
        raise InferenceError(refusal)
    return settings
