"""`Translator`: a translation checkpoint (trained, averaged, an ensemble, LoRA-merged or imported) that
translates texts in any program, without Hydra or Lightning.

Texts are encoded with the checkpoint's own tokenizers and decoded in token-budget batches sorted by
length (`transformer.inference.batches`, the batches of `evaluate.py`'s text translation), with the
checkpoint's test decoding unless told otherwise; results come back in input order. `evaluate.py`'s
`translate.input` and distillation's teachers decode through `decoded_batches`: one batched text path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from data.batching import TranslationCollator
from transformer.evaluation.n_best import n_best_texts
from transformer.evaluation.restore import checkpoint_decoding
from transformer.inference.batches import token_budget_batches
from transformer.inference.languages import TargetLanguages
from transformer.inference.loading import as_paths, device_of, load, max_tokens_of
from transformer.inference.outputs import Hypothesis, InferenceError, Segment, Translation
from transformer.inference.requests import PhraseEncoder
from transformer.search.constraints import TargetRequest, unsatisfiable
from transformer.search.decoding import DecodingSettings, search
from transformer.search.step import LengthLimits

__all__ = ["DecodedBatch", "Translator", "target_langs", "unsatisfiable_rows"]


@dataclass(frozen=True)
class DecodedBatch:
    """One batch as decoded: the input positions of its rows, its source ids (B, S) and the search's tokens
    (B, N, L) on the device, each row's hypotheses (best first) and the rows whose prefix and constraints
    could not fit in their length limit."""

    indices: list[int]
    src: Tensor
    tokens: Tensor
    hypotheses: list[list[Hypothesis]]
    unsatisfiable: frozenset[int]


class Translator:
    """Translates texts with one translation model or an ensemble and the checkpoint's tokenizers.

    `defaults` are the decoding settings `translate` uses where it is given none (for a checkpoint: what its
    test step used); `max_len` cuts a long source (EOS kept) as evaluation does; `max_tokens` is the token
    budget of one batch; `target_languages` what the model translates into (a multilingual model's labels)
    and `target_lang` the language used where a call or a segment names none. Call it from one thread at a
    time."""

    task = "translation"

    def __init__(
        self,
        model: nn.Module,
        src_tokenizer: Any,
        tgt_tokenizer: Any,
        defaults: DecodingSettings,
        *,
        max_len: int,
        max_tokens: int,
        device: str | torch.device | None = None,
        paths: Sequence[Path] = (),
        languages: tuple[str | None, str | None] = (None, None),
        target_languages: TargetLanguages | None = None,
        target_lang: str | None = None,
    ) -> None:
        self.model, self.src_tokenizer, self.tgt_tokenizer = model, src_tokenizer, tgt_tokenizer
        self.defaults, self.max_len, self.max_tokens = defaults, max_len, max_tokens
        self.device = next(model.parameters()).device if device is None else device_of(device)
        self.paths, self.languages = list(paths), languages
        self.target_languages = target_languages or TargetLanguages(target=languages[1])
        self.target_languages.check(target_lang)
        self.target_lang = target_lang
        self._continuations: list[int] | None = None
        self._phrases = PhraseEncoder.of(tgt_tokenizer)

    @classmethod
    def from_checkpoint(
        cls,
        paths: str | Path | Sequence[str | Path],
        *,
        device: str | torch.device = "cpu",
        weights: Sequence[float] | None = None,
        max_tokens: int | None = None,
        average_last: int | None = None,
        target_lang: str | None = None,
    ) -> Translator:
        """The checkpoint at `paths`, or several (an ensemble, `weights` one per member, default equal);
        `average_last`: the mean of the weights of the run's last N checkpoints (not for LoRA runs);
        `max_tokens`: the batches' token budget (default: the checkpoint's `data.eval_max_tokens`);
        `target_lang`: the default target language of a multilingual model (one of its labels')."""
        files = as_paths(paths)
        target = device_of(device)
        loaded = load(files, "translation", weights=weights, average_last=average_last)
        try:
            defaults = checkpoint_decoding(loaded.first.hparams)
        except ValueError as err:
            raise InferenceError(f"checkpoint {files[0]}: its decoding settings: {err}") from None
        return cls(
            loaded.model.to(target).eval(),
            loaded.tokenizers["src"],
            loaded.tokenizers["tgt"],
            defaults,
            max_len=loaded.max_len,
            max_tokens=max_tokens_of(max_tokens, loaded.eval_max_tokens, loaded.max_len),
            device=target,
            paths=loaded.paths,
            languages=loaded.languages,
            target_languages=loaded.target_languages,
            target_lang=target_lang,
        )

    @property
    def num_parameters(self) -> int:
        return sum(parameter.numel() for parameter in self.model.parameters())

    def settings(self, **options: Any) -> DecodingSettings:
        """The defaults with `options` over them (`DecodingSettings`' field names; None keeps a default)."""
        try:
            return DecodingSettings.from_values(options, self.defaults)
        except ValueError as err:
            raise InferenceError(str(err)) from None

    def translate(
        self,
        texts: Sequence[str | Segment],
        settings: DecodingSettings | None = None,
        *,
        generator: torch.Generator | None = None,
        target_lang: str | None = None,
        **options: Any,
    ) -> list[Translation]:
        """One `Translation` per text (a str, or a `Segment` with target requests), in input order.
        `settings` or `options` (as `settings()` takes them) say how to decode; `generator` fixes
        sampling's draws (None: torch's global RNG); `target_lang` the language of the texts whose
        `Segment` names none (None: the translator's `target_lang`)."""
        if settings is not None and options:
            raise InferenceError("give decoding settings or options, not both")
        chosen = self.settings(**options) if settings is None else settings
        if not isinstance(chosen, DecodingSettings):
            raise InferenceError(f"settings must be DecodingSettings, got {type(chosen).__name__}")
        if chosen.alignments:
            raise InferenceError("alignments: translate() gives no word alignments (evaluate.py does)")
        sources, requests = self._inputs(texts)
        langs, where = target_langs(texts, target_lang)
        outputs: list[Translation | None] = [None] * len(sources)
        batches = self.decoded_batches(
            sources, chosen, requests=requests, generator=generator, target_langs=langs, where=where
        )
        for batch in batches:
            for row, index in enumerate(batch.indices):
                outputs[index] = Translation(batch.hypotheses[row], row in batch.unsatisfiable)
        return outputs  # type: ignore[return-value]  # every position filled: each text is in one batch

    def _inputs(self, texts: Sequence[str | Segment]) -> tuple[list[str], list[TargetRequest] | None]:
        """The source texts and (when any segment asks for something) their target requests."""
        if isinstance(texts, (str, Segment)) or not isinstance(texts, Sequence):
            raise InferenceError(f"texts must be a list of strings or Segments, got {type(texts).__name__}")
        sources, requests = [], []
        for i, item in enumerate(texts):
            text = item.text if isinstance(item, Segment) else item
            if not isinstance(text, str):
                raise InferenceError(f"segment {i}: the text must be a string, got {text!r}")
            sources.append(text)
            segment = item if isinstance(item, Segment) else None
            requests.append(self._phrases.request(f"segment {i}", segment) if segment else TargetRequest())
        return sources, requests if any(requests) else None

    def decoded_batches(
        self,
        sources: Sequence[str],
        settings: DecodingSettings,
        *,
        requests: Sequence[TargetRequest] | None = None,
        generator: torch.Generator | None = None,
        target_langs: Sequence[str | None] | None = None,
        where: str | Sequence[str] = "target_lang",
    ) -> Iterator[DecodedBatch]:
        """The token-budget batches of `sources` (each with its `requests`, target token ids), decoded;
        each source into its language of `target_langs` (None, or a None in it: the translator's
        `target_lang`), `where` naming the setting each came from in the error line of an unknown one."""
        ids = self.src_tokenizer.encode_batch(self.labelled(sources, target_langs, where))
        collate = TranslationCollator(getattr(self.tgt_tokenizer, "pad_id", self.model.config.pad_id))
        config = self.model.config
        batches = token_budget_batches(ids, max_len=self.max_len, max_tokens=self.max_tokens, collate=collate)
        for batch in batches:
            indices = batch["id"].tolist()
            src = batch["src"].to(self.device)  # (B, S)
            mine = [requests[i] for i in indices] if requests is not None else None
            try:
                tokens, scores = search(
                    self.model,
                    src,
                    settings,
                    generator,
                    requests=mine if mine is not None and any(mine) else None,
                    word_continuations=self._word_continuations() if mine else (),
                )
            except ValueError as err:  # requests the settings cannot serve (sampling with constraints)
                raise InferenceError(str(err)) from None
            decode = self.tgt_tokenizer.decode_batch
            lists = n_best_texts(tokens, scores, decode, config.eos_id, config.pad_id)
            hypotheses = [[Hypothesis(text, score) for text, score in row] for row in lists]
            flagged = frozenset(unsatisfiable_rows(config, src, settings, mine)[0]) if mine else frozenset()
            yield DecodedBatch(indices, src, tokens, hypotheses, flagged)

    def labelled(
        self,
        sources: Sequence[str],
        target_langs: Sequence[str | None] | None = None,
        where: str | Sequence[str] = "target_lang",
    ) -> list[str]:
        """`sources` as the source tokenizer takes them: labelled with their target languages (a
        multilingual model), the translator's `target_lang` where none is given."""
        langs = [self.target_lang] * len(sources) if target_langs is None else list(target_langs)
        langs = [self.target_lang if lang is None else lang for lang in langs]
        return self.target_languages.sources(list(sources), langs, where)

    def _word_continuations(self) -> list[int]:
        """The target pieces that continue a word (required phrases end at a word end), found once."""
        if self._continuations is None:
            find = getattr(self.tgt_tokenizer, "word_continuations", None)
            self._continuations = list(find()) if find is not None else []
        return self._continuations


def target_langs(
    texts: Sequence[str | Segment], target_lang: str | None
) -> tuple[list[str | None], list[str]]:
    """Each text's target language (its `Segment`'s, else `target_lang`; None: the translator's default) and
    the name of the setting it came from, for the error line of a language the model does not know."""
    langs: list[str | None] = []
    where = []
    for i, item in enumerate(texts):
        own = item.target_lang if isinstance(item, Segment) else None
        if own is not None and not isinstance(own, str):
            raise InferenceError(f"segment {i}: target_lang must be a string, got {own!r}")
        langs.append(own if own is not None else target_lang)
        where.append(f"segment {i}: target_lang" if own is not None else "target_lang")
    return langs, where


def unsatisfiable_rows(
    config: Any, src: Tensor, settings: DecodingSettings, requests: Sequence[TargetRequest]
) -> tuple[list[int], list[int]]:
    """The rows of a batch whose prefix and required phrases cannot fit in their length limit, and every
    row's limit (tokens, EOS included); ([], []) when no row asks for a prefix or a phrase."""
    if not any(request.prefix or request.include for request in requests):
        return [], []
    limits = LengthLimits.of(config, src, settings.max_len_a, settings.max_len_b).per_sentence.tolist()
    return unsatisfiable(requests, limits), limits
