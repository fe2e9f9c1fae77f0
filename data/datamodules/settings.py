"""The settings every task's datamodule shares (splits, tokenizer, batching, cache): one frozen record,
checked once. Configs keep them as flat `data.*` keys beside the task's own; `TokenizedDataModule` builds
this record from them, with the task's defaults (`settings_defaults`) for what it does not set."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.tokenization import SPECIAL_TOKENS

TOKENIZER_SAMPLE_SIZE = 1_000_000  # training examples a tokenizer learns from (more: a seeded sample)


@dataclass(frozen=True)
class TokenizedSettings:
    """Splits, tokenizer, batching and cache settings of a datamodule; `eval_max_tokens` None means
    `max_tokens`, `cache_dir` None means no prepared-data cache."""

    train_split: str = "train"
    val_split: str = "val"
    test_split: str = "test"
    vocab_size: int = 8000
    min_frequency: int = 2
    max_tokens: int = 4096
    eval_max_tokens: int | None = None
    max_len: int = 256
    pool_size: int | None = None
    max_sentences: int | None = None
    num_workers: int = 0
    cache_dir: str | Path | None = None
    seed: int = 0
    show_progress: bool = True
    bpe_dropout: float = 0.0
    tokenizer_sample_size: int | None = TOKENIZER_SAMPLE_SIZE

    def __post_init__(self) -> None:
        if self.eval_max_tokens is None:
            object.__setattr__(self, "eval_max_tokens", self.max_tokens)
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        self._check()

    def _check(self) -> None:
        """Raise ValueError naming the first setting out of range (each is checked here, once)."""
        if self.tokenizer_sample_size is not None and self.tokenizer_sample_size < 1:
            raise ValueError(f"tokenizer_sample_size must be >= 1 or null, got {self.tokenizer_sample_size}")
        if not 0.0 <= self.bpe_dropout < 1.0:
            raise ValueError(f"bpe_dropout must be in [0, 1), got {self.bpe_dropout}")
        if self.vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens {list(SPECIAL_TOKENS)}, "
                f"got {self.vocab_size}"
            )
        for name, value in (("min_frequency", self.min_frequency), ("seed", self.seed)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name, value in (("pool_size", self.pool_size), ("max_sentences", self.max_sentences)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or null, got {value}")
        if self.max_len < 3:
            raise ValueError(f"max_len must leave room for BOS, EOS and a token, got {self.max_len}")
        for name, value in (("max_tokens", self.max_tokens), ("eval_max_tokens", self.eval_max_tokens)):
            if value < self.max_len:
                raise ValueError(
                    f"{name} ({value}) must be at least max_len ({self.max_len}): one example must fit"
                )
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")

    @classmethod
    def from_keys(cls, owner: str, keys: Mapping[str, Any], defaults: Mapping[str, Any]) -> TokenizedSettings:
        """The settings from a datamodule's flat keyword arguments, `defaults` for those not given; an
        unknown key is the TypeError Python raises for `owner.__init__`."""
        names = {field.name for field in dataclasses.fields(cls)}
        for name in keys:
            if name not in names:
                raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {name!r}")
        return cls(**{**defaults, **keys})

    @classmethod
    def parameters(cls, defaults: Mapping[str, Any]) -> list[inspect.Parameter]:
        """The settings as keyword-only parameters (with `defaults` over the record's own), for the
        signature a datamodule shows `inspect` and readers."""
        hints = typing.get_type_hints(cls)  # the fields' annotations resolved (not strings): checkable
        return [
            inspect.Parameter(
                field.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults.get(field.name, field.default),
                annotation=hints[field.name],
            )
            for field in dataclasses.fields(cls)
        ]
