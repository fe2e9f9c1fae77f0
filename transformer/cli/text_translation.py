"""The `Translator` that `evaluate.py`'s text streams decode with: the checkpoint's target languages and
`translate.target_lang` checked before any line is read, lines (or JSONL entries) translated in the
inference API's batches with their word alignments, and rows whose prefix and constraints cannot fit in
their length limit reported by input line. Distillation's teachers build theirs with `translator_of`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from transformer.cli.errors import ConfigError
from transformer.cli.translate_input import Entry
from transformer.cli.word_alignments import Aligner, piece_function
from transformer.inference.languages import TargetLanguages
from transformer.inference.loading import check_shared_labels, target_languages_of
from transformer.inference.outputs import InferenceError
from transformer.inference.translator import Translator, unsatisfiable_rows
from transformer.search.constraints import TargetRequest
from transformer.search.decoding import DecodingSettings

log = logging.getLogger("evaluate")


@dataclass(frozen=True)
class Translation:
    """One input line's outputs: its hypotheses [(text, score), ...] best first, their alignment lines
    (None: not asked for), and whether its prefix and constraints could not fit in its length limit."""

    hypotheses: list[tuple[str, float]]
    alignments: list[str] | None = None
    unsatisfiable: bool = False


def target_languages(restored: Sequence[Any], paths: Sequence[Path]) -> TargetLanguages:
    """What the checkpoint(s) of `paths` translate into (an ensemble's members must share their labels):
    one ConfigError line naming the member otherwise."""
    try:
        check_shared_labels(restored, paths)
        return target_languages_of(restored[0], paths[0])
    except InferenceError as err:
        raise ConfigError(f"ckpt_path: {err}") from None


def check_target_lang(targets: TargetLanguages, target_lang: Any, form: str) -> None:
    """translate.target_lang checked before any line is read: a language the model knows (a bilingual
    model: its own target, or none), given for a multilingual model's plain-text input."""
    if target_lang is not None and not isinstance(target_lang, str):
        raise ConfigError(f"translate.target_lang must be a language code, got {target_lang!r}")
    if target_lang is None and targets.multilingual and form == "text":
        raise ConfigError(
            "translate.target_lang: this model is multilingual; choose a target language: "
            f"{', '.join(targets.languages)} (or give each line its target_lang with translate.format=jsonl)"
        )
    try:
        targets.check(target_lang, "translate.target_lang")
    except InferenceError as err:
        raise ConfigError(str(err)) from None


def translator_of(
    model: Any,
    datamodule: Any,
    decoding: DecodingSettings,
    device: torch.device,
    targets: TargetLanguages | None = None,
    target_lang: str | None = None,
) -> Translator:
    """The inference API's `Translator` of `model` (one, or an ensemble) with the datamodule's tokenizers
    and batching (its `max_len` and `eval_max_tokens`, overrides included), into `target_lang` of `targets`
    (a multilingual model's): evaluate.py's text translation and distillation's teachers decode through
    it."""
    return Translator(
        model,
        datamodule.src_tokenizer,
        datamodule.tgt_tokenizer,
        decoding,
        max_len=datamodule.max_len,
        max_tokens=datamodule.eval_max_tokens,
        device=device,
        target_languages=targets,
        target_lang=target_lang,
    )


def line_translator(
    model: Any,
    datamodule: Any,
    decoding: DecodingSettings,
    device: torch.device,
    name: str,
    align: bool,
    targets: TargetLanguages,
    target_lang: str | None,
) -> Callable[[list[Any]], list[Translation]]:
    """Texts (or JSONL `Entry`s) -> their `Translation`s, decoded in the inference API's batches, each
    into its target language (its line's, else `target_lang`)."""
    translator = translator_of(model, datamodule, decoding, device, targets, target_lang)
    config = model.config
    specials = {config.pad_id, config.bos_id, config.eos_id}
    # a source's label is no word of it: its alignments count the words of the line as given
    labels = targets.labels.tokens if targets.labels is not None else []
    label_ids = {i for label in labels for i in datamodule.src_tokenizer.encode(label)} - specials
    aligner = (
        Aligner(
            model,
            decoding.alignment_layer,
            piece_function(datamodule.src_tokenizer, specials | label_ids),
            piece_function(datamodule.tgt_tokenizer, specials),
        )
        if align
        else None
    )

    def translate(items: list[Any]) -> list[Translation]:
        entries = [item if isinstance(item, Entry) else Entry(0, item, TargetRequest()) for item in items]
        outputs: list[Translation] = [Translation([]) for _ in entries]
        requests = [entry.request for entry in entries]
        batches = translator.decoded_batches(
            [entry.src for entry in entries],
            decoding,
            requests=requests if any(requests) else None,
            target_langs=[entry.target_lang for entry in entries],
            where=[f"{name} line {entry.line}: target_lang" for entry in entries],
        )
        for batch in batches:
            mine = [entries[i] for i in batch.indices]
            flagged = _unsatisfiable(config, batch.src, decoding, mine, name)
            lists = [[(h.text, h.score) for h in hypotheses] for hypotheses in batch.hypotheses]
            aligned = None
            if aligner is not None:
                texts = [[text for text, _ in hypotheses] for hypotheses in lists]
                aligned = aligner.lines(batch.src, batch.tokens, [entry.src for entry in mine], texts)
            for j, index in enumerate(batch.indices):
                outputs[index] = Translation(lists[j], aligned[j] if aligned else None, j in flagged)
        return outputs

    return translate


def _unsatisfiable(
    config: Any, src: torch.Tensor, decoding: DecodingSettings, entries: list[Entry], name: str
) -> set[int]:
    """The batch rows whose prefix and constraints cannot fit in their length limit, each reported as a
    warning naming its input line (their outputs miss some: they are decoded all the same)."""
    requests = [entry.request for entry in entries]
    flagged, limits = unsatisfiable_rows(config, src, decoding, requests)
    for row in flagged:
        log.warning(
            "%s line %d: the prefix and constraints need %d tokens with EOS, but the length limit is %d: "
            "the output misses some (%s)",
            name,
            entries[row].line,
            requests[row].needed,
            limits[row],
            _binding_limit(limits[row], config.max_len, decoding),
        )
    return set(flagged)


def _binding_limit(limit: int, model_max_len: int, decoding: DecodingSettings) -> str:
    """Which limit caps a sentence, and what raises it: the model's positions cannot be raised."""
    if limit >= model_max_len:  # `LengthLimits` clamps a * src_len + b to the model's max_len
        return (
            f"the model's max_len of {model_max_len} positions caps it, whatever decode.max_len_a / "
            "max_len_b say: shorten the prefix or the required phrases"
        )
    return (
        f"decode.max_len_a * source length + decode.max_len_b = {decoding.max_len_a:g} * source length + "
        f"{decoding.max_len_b:g} caps it: raise decode.max_len_b (the model's max_len is {model_max_len})"
    )
