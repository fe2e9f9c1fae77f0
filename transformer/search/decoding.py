"""Decoding: greedy search, sampling and beam search over the decoder's KV cache, and the one settings
type that says which to run (`DecodingSettings`, `decode`, `search`).

Every search takes one step at a time through `transformer.search.step.next_log_probs` (one new
position through the cached decoder, log-softmax, the step rules), on a `Seq2SeqTransformer` or an
`Ensemble`. Greedy search and sampling keep one hypothesis per row and differ only in how a row picks
its next token; beam search (`transformer.search.beam`) ranks K per sentence. Hypotheses are returned
without the leading BOS, ending with EOS, right-padded with pad_id. Bookkeeping stays on the device:
each step reads back one number, how many rows are still decoding; rows that finish leave the batch,
so no sentence's result depends on the others in its batch. With a static KV cache
(`DecodingSettings.kv_cache`, `transformer.search.static_cache`) the rows stay and finished ones are masked,
so every step has the same shapes and the step can run as one compiled graph; the outputs are the same.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from transformer.kernels import attention_backends
from transformer.search.beam import beam_search_loop
from transformer.search.constraints import ConstraintState, TargetRequest
from transformer.search.rows import argmax, row_search, samples
from transformer.search.static_cache import Stepping
from transformer.search.step import (
    LENGTH_NORMALIZATIONS,
    LengthNormalizer,
    Sampler,
    Searchable,
    StepRules,
    eval_mode,
)

__all__ = ["DecodingSettings", "beam_search", "decode", "greedy_search", "sample", "search"]

# auto: greedy search for beam_size 1, beam search otherwise; sample: sampling (beam_size unused)
SEARCHES = ("auto", "greedy", "beam", "sample")
# the decoder's self-attention KV cache and how the step runs over it (`DecodingSettings.kv_cache`)
KV_CACHES = ("auto", "dynamic", "static", "graphed", "compiled")


@dataclass(frozen=True, eq=False)
class DecodingSettings(Mapping[str, Any]):
    """How to decode: the one settings type of validation and test (`model.decoding`,
    `model.test_decoding`), of `evaluate.py` (`decode.*`, `configs/decode/`) and of the exports.

    A read-only mapping of its fields, so that it is stored in checkpoints and reports as plain data.
    Defaults: greedy search (beam 1), GNMT's length penalty with alpha 0.6, at most 1.2 * source length + 10
    tokens, one hypothesis per sentence, no sampling cut-offs, no length or n-gram constraints.

    `kv_cache` changes how fast, never what is decoded (in bf16, up to rounding: the padded shapes of
    the static cache run other kernels): "dynamic" grows the cache as decoding goes and drops finished
    rows from the batch; "static" preallocates it at the search's maximum length and keeps every row
    (finished ones masked), so every step after the first has the same shapes; "graphed" (CUDA only) is
    "static" with each step a replayed CUDA graph, recorded from the eager step without a compiler
    (`transformer.search.graphed`); "compiled" is "static" with the step through `torch.compile` (a
    CUDA graph on CUDA: `transformer.search.static_cache.compile_step`). "auto" is "graphed" on CUDA and
    "dynamic" elsewhere, and "dynamic" wherever a search needs the growing cache (prefixes and
    constraints, n-gram blocking). "compiled" pays its compilation before the first sentence: use it for
    corpus-sized jobs only where it measures faster (docs/gpu.md and benchmarks/README.md have the
    measurements: GPU and CPU).
    """

    search: str = "auto"  # auto | greedy | beam | sample (auto: greedy for beam_size 1, else beam)
    beam_size: int = 1
    length_penalty: float = 0.6  # alpha of the length normalization: the scores of every search
    # gnmt: scores / ((5 + len) / 6) ** alpha (Wu et al., 2016); power: scores / len ** alpha (transformers'
    # generate, fairseq, Marian: an imported OPUS-MT model's own); len counts EOS, not BOS
    length_normalization: str = "gnmt"
    max_len_a: float = 1.2  # a hypothesis may have up to max_len_a * source length + max_len_b tokens
    max_len_b: float = 10.0
    n_best: int = 1  # hypotheses per sentence: the n best of the beam, or n independent samples
    top_k: int = 0  # sampling: only the k most likely tokens (0 = no cut)
    top_p: float = 1.0  # sampling: the smallest set of most likely tokens with this much probability
    temperature: float = 1.0  # the logits are divided by it before the softmax
    min_len: int = 0  # EOS is banned before this many tokens (fairseq's --min-len)
    no_repeat_ngram_size: int = 0  # no n-gram of this size occurs twice in a hypothesis (0 = off)
    kv_cache: str = "auto"  # auto | dynamic | static | graphed | compiled (auto: graphed on CUDA; above)
    alignments: bool = False  # word alignments of the outputs, from cross-attention (search.alignments)
    alignment_layer: int = -2  # the decoder layer they come from (negative: from the top; Garg et al.)

    def __post_init__(self) -> None:
        _check_settings(dict(self))

    @classmethod
    def from_values(
        cls, values: Mapping[str, Any] | None, base: Mapping[str, Any] | None = None, prefix: str = ""
    ) -> DecodingSettings:
        """`base` (the defaults where it has no value) with the non-null `values` on top. An unknown key
        or a value that cannot work raises ValueError naming `<prefix><key>`."""
        merged = {**cls().__dict__, **{k: v for k, v in (base or {}).items() if v is not None}}
        for key, value in (values or {}).items():
            if key not in merged:
                raise ValueError(f"unknown decoding option {prefix}{key}; expected some of {list(merged)}")
            if value is not None:
                merged[key] = value
        _check_settings(merged, prefix)
        return cls(**merged)

    @property
    def greedy(self) -> bool:
        return self.search == "greedy" or (self.search == "auto" and self.beam_size == 1)

    @property
    def sampling(self) -> bool:
        return self.search == "sample"

    @property
    def length_normalizer(self) -> LengthNormalizer:
        """What every search divides a hypothesis' summed log-probability by."""
        return LengthNormalizer(self.length_penalty, self.length_normalization)

    def stepping(self, device: torch.device, requests: bool = False) -> Stepping:
        """How the searches run their steps on `device`, as `kv_cache` says; `requests`: the search has
        prefixes or constraints (with n-gram blocking, "auto" keeps the growing cache for them)."""
        return Stepping.of(self.kv_cache, device, growing=requests or self.no_repeat_ngram_size > 0)

    def rules(self, model: Searchable) -> StepRules:
        """The step rules these settings give `model`'s special tokens."""
        config = model.config
        return StepRules(
            config.pad_id,
            config.bos_id,
            config.eos_id,
            self.min_len,
            self.no_repeat_ngram_size,
            self.temperature,
        )

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


def _check_settings(settings: Mapping[str, Any], prefix: str = "") -> None:
    """Raise ValueError naming `<prefix><key>` for a decoding setting that cannot work."""

    def integer(key: str, least: int) -> int:
        value = settings.get(key, least)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{prefix}{key} must be an integer >= {least}, got {value!r}")
        return value

    def number(key: str) -> float:
        value = settings.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{prefix}{key} must be a finite number, got {value!r}")
        return value

    beam_size, n_best = integer("beam_size", 1), integer("n_best", 1)
    for key in ("top_k", "min_len", "no_repeat_ngram_size"):
        integer(key, 0)
    if not isinstance(settings.get("alignments", False), bool):
        raise ValueError(f"{prefix}alignments must be true or false, got {settings['alignments']!r}")
    layer = settings.get("alignment_layer", -2)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(
            f"{prefix}alignment_layer must be an integer (negative: from the top), got {layer!r}"
        )
    normalization = settings.get("length_normalization", "gnmt")
    if normalization not in LENGTH_NORMALIZATIONS:
        raise ValueError(
            f"{prefix}length_normalization must be one of {list(LENGTH_NORMALIZATIONS)}, "
            f"got {normalization!r}"
        )
    search = settings.get("search", "auto")
    if search not in SEARCHES:
        raise ValueError(f"{prefix}search must be one of {list(SEARCHES)}, got {search!r}")
    kv_cache = settings.get("kv_cache", "auto")
    if kv_cache not in KV_CACHES:
        raise ValueError(f"{prefix}kv_cache must be one of {list(KV_CACHES)}, got {kv_cache!r}")
    if kv_cache in ("graphed", "compiled") and settings.get("no_repeat_ngram_size", 0):
        raise ValueError(
            f"{prefix}kv_cache={kv_cache} cannot block repeated n-grams ({prefix}no_repeat_ngram_size="
            f"{settings['no_repeat_ngram_size']}): the history it reads grows every step, which would "
            "record or compile the step again each time; use kv_cache=auto, static or dynamic"
        )
    if search == "greedy" and beam_size != 1:
        raise ValueError(f"{prefix}search=greedy keeps one hypothesis, but {prefix}beam_size={beam_size}")
    if search != "sample" and n_best > beam_size:
        raise ValueError(
            f"{prefix}n_best must be <= {prefix}beam_size ({beam_size}) in beam and greedy search, "
            f"got {n_best}"
        )
    for key in ("length_penalty", "max_len_a", "max_len_b"):
        if number(key) < 0 and key != "length_penalty":
            raise ValueError(f"{prefix}{key} must be >= 0, got {settings[key]!r}")
    if not 0 < number("top_p") <= 1:
        raise ValueError(f"{prefix}top_p must be in (0, 1], got {settings['top_p']!r}")
    if number("temperature") <= 0:
        raise ValueError(f"{prefix}temperature must be > 0, got {settings['temperature']!r}")


# the wrappers' defaults (`greedy_search`, `sample`, `beam_search`): DecodingSettings' own, never restated
_DEFAULT = DecodingSettings()


@torch.no_grad()
def search(
    model: Searchable,
    src: Tensor,
    settings: DecodingSettings,
    generator: torch.Generator | None = None,
    requests: Sequence[TargetRequest] | None = None,
    word_continuations: Sequence[int] = (),
) -> tuple[Tensor, Tensor]:
    """src (B, S) -> (hypotheses (B, n_best, L) long, scores (B, n_best) float) as `settings` say, best
    first. Scores are the search's own: summed log-probabilities / ((5 + len) / 6) ** length_penalty
    (`length_normalization` gnmt) or / len ** length_penalty (power), len counting EOS.
    `generator` fixes sampling's draws (None: torch's global RNG, as seeded by the entry points).
    `requests` (one per sentence, `transformer.search.constraints`): target prefixes, required and
    avoided phrases; greedy search with any of them is beam search with one beam (the same tokens),
    sampling takes prefixes and avoided phrases only. `word_continuations` (the target tokenizer's
    pieces that continue a word) make every required phrase end at a word end."""
    lengths = {"max_len_a": settings.max_len_a, "max_len_b": settings.max_len_b}
    has_requests = requests is not None and any(requests)
    rules = settings.rules(model)
    if has_requests:
        _check_requests(settings, requests, src.size(0))
        constraints = ConstraintState(requests, src.device, word_continuations)
        rules = dataclasses.replace(rules, constraints=constraints)
    stepping = settings.stepping(src.device, has_requests)
    penalty = settings.length_normalizer
    with eval_mode(model), attention_backends(src.device):  # entered once, not in each attention call
        if settings.sampling:
            sampler = Sampler(settings.top_k, settings.top_p, generator)
            return samples(model, src, rules, sampler, settings.n_best, penalty, lengths, stepping)
        if settings.greedy and rules.constraints is None:
            tokens, scores = row_search(model, src, rules, argmax, penalty, **lengths, stepping=stepping)
            return tokens.unsqueeze(1), scores.unsqueeze(1)
        return beam_search_loop(
            model,
            src,
            rules,
            settings.beam_size,
            penalty,
            n_best=settings.n_best,
            stepping=stepping,
            **lengths,
        )


def _check_requests(settings: DecodingSettings, requests: Sequence[TargetRequest], batch: int) -> None:
    """ValueError for requests the settings cannot serve."""
    if len(requests) != batch:
        raise ValueError(f"{len(requests)} constraint requests for a batch of {batch} sentences")
    if settings.kv_cache in ("static", "graphed", "compiled"):
        raise ValueError(
            f"decode.kv_cache={settings.kv_cache} cannot decode with prefixes or constraints (their "
            "bookkeeping follows the rows of the growing cache); use decode.kv_cache=dynamic"
        )
    if settings.sampling and any(request.include for request in requests):
        raise ValueError(
            "required phrases (constraints) need beam or greedy search, not decode.search=sample "
            "(prefix and avoid work with sampling)"
        )


def decode(
    model: Searchable, src: Tensor, settings: DecodingSettings, generator: torch.Generator | None = None
) -> Tensor:
    """src (B, S) -> the best hypothesis of each sentence (B, L) as `settings` say: token ids after BOS,
    EOS-terminated, pad-filled."""
    return search(model, src, settings, generator)[0][:, 0]


def greedy_search(
    model: Searchable,
    src: Tensor,
    *,
    max_len_a: float = _DEFAULT.max_len_a,
    max_len_b: float = _DEFAULT.max_len_b,
    min_len: int = _DEFAULT.min_len,
    no_repeat_ngram_size: int = _DEFAULT.no_repeat_ngram_size,
) -> Tensor:
    """src (B, S) long -> hypotheses (B, L) long: the most likely token at each step, until EOS.

    Rows hold the tokens after BOS, ending with EOS (forced at the sentence's max length
    floor(max_len_a * src_len + max_len_b)), then pad_id; L is the longest hypothesis. `min_len` and
    `no_repeat_ngram_size` as in `DecodingSettings`.
    """
    settings = DecodingSettings(
        search="greedy",
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        min_len=min_len,
        no_repeat_ngram_size=no_repeat_ngram_size,
    )
    return decode(model, src, settings)


def sample(
    model: Searchable,
    src: Tensor,
    *,
    top_k: int = _DEFAULT.top_k,
    top_p: float = _DEFAULT.top_p,
    temperature: float = _DEFAULT.temperature,
    n_best: int = _DEFAULT.n_best,
    length_penalty: float = _DEFAULT.length_penalty,
    length_normalization: str = _DEFAULT.length_normalization,
    max_len_a: float = _DEFAULT.max_len_a,
    max_len_b: float = _DEFAULT.max_len_b,
    min_len: int = _DEFAULT.min_len,
    no_repeat_ngram_size: int = _DEFAULT.no_repeat_ngram_size,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """src (B, S) -> n_best independent samples per sentence (B, n_best, L) and their scores (B, n_best),
    best first; the other arguments as in `DecodingSettings`. top_k=1 is greedy search."""
    settings = DecodingSettings(
        search="sample",
        top_k=top_k,
        top_p=top_p,
        temperature=temperature,
        n_best=n_best,
        length_penalty=length_penalty,
        length_normalization=length_normalization,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        min_len=min_len,
        no_repeat_ngram_size=no_repeat_ngram_size,
    )
    return search(model, src, settings, generator)


def beam_search(
    model: Searchable,
    src: Tensor,
    *,
    beam_size: int = 4,  # the wrapper's own: DecodingSettings' is 1 (greedy search)
    length_penalty: float = _DEFAULT.length_penalty,
    length_normalization: str = _DEFAULT.length_normalization,
    max_len_a: float = _DEFAULT.max_len_a,
    max_len_b: float = _DEFAULT.max_len_b,
    n_best: int = _DEFAULT.n_best,
    min_len: int = _DEFAULT.min_len,
    no_repeat_ngram_size: int = _DEFAULT.no_repeat_ngram_size,
) -> tuple[Tensor, Tensor]:
    """src (B, S) long -> (hypotheses (B, n_best, L) long, scores (B, n_best) float), best first.

    Score = sum of token log-probabilities / ((5 + len) / 6) ** length_penalty (Wu et al., 2016; with
    length_normalization="power": / len ** length_penalty, transformers' and fairseq's), len counting EOS
    (`transformer.search.beam`). beam_size=1 reproduces `greedy_search` token for
    token. A sentence with fewer than n_best finished hypotheses (possible only for tiny max lengths)
    gets pad_id rows scored -inf. `min_len` and `no_repeat_ngram_size` as in `DecodingSettings`.
    """
    settings = DecodingSettings(  # checks beam_size and n_best (`_check_settings`)
        search="beam",
        beam_size=beam_size,
        length_penalty=length_penalty,
        length_normalization=length_normalization,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        n_best=n_best,
        min_len=min_len,
        no_repeat_ngram_size=no_repeat_ngram_size,
    )
    return search(model, src, settings)
