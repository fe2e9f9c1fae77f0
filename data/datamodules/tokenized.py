"""From raw splits to token ids, for every task: the shared settings and their checks, the hooks a task
fills in, tokenizer training (or reuse from `cache_dir`) and tokenized splits in the prepared-data cache.

`prepare_data` trains (or reuses) the tokenizer(s) under `cache_dir`; `setup` tokenizes the splits a
stage needs (dropping over-long training examples) into Arrow files under `cache_dir` (`data.cache`),
or memory-maps them from there when a process already did.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import datasets
import lightning as L
import tokenizers

from data import cache, prepare, sources, tokenization
from data.bpe_cache import shared_bpe
from data.datamodules.settings import TokenizedSettings
from data.tokenization import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    BPETokenizer,
    CorpusEncoder,
    corpus_encoder,
    tokenizer_from_json,
)

log = logging.getLogger(__name__)

_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ()}

T = TypeVar("T")


class _Setting(Generic[T]):
    """A datamodule attribute that reads one field of its `settings` record (the one copy of the value):
    `max_len = _Setting[int]()` reads `settings.max_len`; `_Setting("vocab_size")` another field."""

    def __init__(self, field: str | None = None) -> None:
        self.field = field

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = self.field or name

    def __get__(self, obj: Any, objtype: type | None = None) -> T:
        if obj is None:
            return self  # type: ignore[return-value]  # the class's own attribute: the descriptor
        return getattr(obj.settings, self.field)  # type: ignore[arg-type]


class TokenizedDataModule(L.LightningDataModule):
    """What both tasks share up to token ids: the settings, tokenizer and tokenized-split caching, length
    filtering, the tokenizers in the checkpointed state."""

    @property
    def pad_id(self) -> int:
        return self._special_id("pad_id", PAD_ID)

    @property
    def bos_id(self) -> int:
        return self._special_id("bos_id", BOS_ID)

    @property
    def eos_id(self) -> int:
        return self._special_id("eos_id", EOS_ID)

    def _special_id(self, name: str, fixed: int) -> int:
        """The target tokenizer's id: this project's BPE has the fixed ids of `data.tokenization`, an
        imported model's tokenizer (`data.sentencepiece_pair`) its vocabulary's own."""
        tokenizer = getattr(self, "_tokenizers", {}).get("tgt")
        return fixed if tokenizer is None else getattr(tokenizer, name)

    # the shared settings, as the code reads them: each a field of `self.settings` (`TokenizedSettings`)
    vocab_size_requested = _Setting[int]("vocab_size")
    min_frequency = _Setting[int]()
    max_tokens = _Setting[int]()
    eval_max_tokens = _Setting[int]()  # resolved by the record: never None
    max_len = _Setting[int]()
    pool_size = _Setting["int | None"]()
    max_sentences = _Setting["int | None"]()
    num_workers = _Setting[int]()
    cache_dir = _Setting["Path | None"]()  # a Path once checked
    seed = _Setting[int]()
    show_progress = _Setting[bool]()
    bpe_dropout = _Setting[float]()
    tokenizer_sample_size = _Setting["int | None"]()

    _text_columns: tuple[str, ...]  # raw columns that are tokenized, e.g. ("src", "tgt")
    _id_columns: tuple[str, ...]  # the token-id columns `_encode` returns, e.g. ("src_ids", "tgt_ids")

    # the task's own defaults for shared settings, over `TokenizedSettings`' (e.g. {"max_len": 128})
    settings_defaults: ClassVar[Mapping[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Show each task's signature as its own arguments then the shared settings (the flat `data.*`
        keys a config may set), with the task's defaults."""
        super().__init_subclass__(**kwargs)
        own = inspect.signature(cls.__init__).parameters.values()
        task = [p for p in own if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
        cls.__signature__ = inspect.Signature([*task, *TokenizedSettings.parameters(cls.settings_defaults)])

    def __init__(self, **settings: Any) -> None:
        """`settings`: the shared flat keys (`TokenizedSettings`' fields), checked once by that record."""
        super().__init__()
        self.settings = TokenizedSettings.from_keys(type(self).__name__, settings, self.settings_defaults)
        given = self.settings
        self.splits = {"train": given.train_split, "val": given.val_split, "test": given.test_split}
        self.predict_texts: list[str] | None = None  # predict_dataloader decodes these (None: test sources)
        self._raw: dict[str, datasets.Dataset] = {}
        self._tokenized: dict[str, datasets.Dataset] = {}
        self._tokenizers: dict[str, BPETokenizer] = {}  # "src" and "tgt" (same object when joint)

    # -- hooks for the subclasses ------------------------------------------------------------------
    def _load_raw(self, splits: Sequence[str]) -> datasets.DatasetDict:
        raise NotImplementedError

    def _tokenizer_columns(self) -> dict[str, list[str]]:
        """Raw columns each tokenizer learns from: {"joint": [...]} or {"src": [...], "tgt": [...]}."""
        raise NotImplementedError

    def _special_tokens(self) -> tuple[str, ...]:
        """Tokens besides the four fixed ones that the tokenizer must keep whole (e.g. a tag)."""
        return ()

    def _files(self, split: str) -> list[Path] | None:
        """The local files `split` is read from (their identity keys the cache), None for generated or
        hub data (keyed by the loaded split's `datasets` fingerprint)."""
        raise NotImplementedError

    def _settings(self) -> dict[str, Any]:
        """The settings besides the files that change a split's text or labels (languages, columns)."""
        raise NotImplementedError

    def _entry_meta(self) -> dict[str, Any]:
        """What a cache entry keeps besides the ids, given back to `_restore_meta` on later loads."""
        return {}

    def _restore_meta(self, meta: Mapping[str, Any]) -> None:
        """Take back what `_entry_meta` stored (e.g. class names) when a split comes from the cache."""

    def _encode(
        self, batch: Mapping[str, list[Any]], encoders: Mapping[str, CorpusEncoder]
    ) -> dict[str, list[Any]]:
        """{"src_ids": ...} (and "tgt_ids") of a batch of raw rows, with the "src" / "tgt" encoders."""
        raise NotImplementedError

    # -- raw splits --------------------------------------------------------------------------------
    def raw_split(self, split: str) -> datasets.Dataset:
        """The raw split by name (loaded once; ids index its rows)."""
        if split not in self._raw:
            self._raw.update(self._load_raw([split]))
        return self._raw[split]

    def keep_first(self, split: str, n: int) -> int:
        """Keep only the first `n` examples of `split` (evaluate.py's quick subset); returns how many the
        split had. Only without `cache_dir`: the cut split must never be cached as the whole one."""
        if self.cache_dir is not None:
            raise RuntimeError("keep_first needs a datamodule without cache_dir")
        raw = self.raw_split(split)
        self._raw[split] = raw.select(self._first_rows(raw, n))
        self._tokenized.pop(split, None)  # tokenized again from the cut split
        return len(raw)

    def _first_rows(self, raw: datasets.Dataset, n: int) -> list[int]:
        """The rows `keep_first` keeps: the first `n`."""
        return list(range(min(n, len(raw))))

    # -- tokenizers ------------------------------------------------------------------------------
    @property
    def src_tokenizer(self) -> BPETokenizer:
        return self._tokenizer("src")

    def _tokenizer(self, side: str) -> BPETokenizer:
        if side not in self._tokenizers:
            raise RuntimeError(
                "tokenizers are not ready: call prepare_data() and setup() (or load_state_dict) first"
            )
        return self._tokenizers[side]

    def prepare_data(self) -> None:
        """Rank 0, before `setup`: train the tokenizer(s) or reuse matching ones from `cache_dir`, and
        tokenize the splits of the trainer's stage (if one is attached) into it: other ranks only read."""
        if self.cache_dir is None:
            return
        self._ensure_tokenizers()
        trainer = self._trainer_or_none()
        stage = trainer.state.fn.value if trainer is not None and trainer.state.fn is not None else None
        for role in _STAGE_SPLITS.get(stage, ()) if stage else ():
            self.tokenized(self.splits[role])

    def _ensure_tokenizers(self) -> None:
        """Tokenizers from `cache_dir` when trained on the same data with the same settings, else trained.

        The cache key is the train split's identity (files: path, size, mtime), not its text: a later run
        finds its tokenizer without reading the corpus. One process trains, the others wait for it.
        """
        if self._tokenizers:
            return
        trained: dict[str, BPETokenizer] = {}
        for side, columns in self._tokenizer_columns().items():
            if self.cache_dir is None:
                trained[side] = self._train_tokenizer(columns, None)
                continue
            key = cache.cache_key(
                {
                    "kind": "tokenizer",
                    "columns": columns,
                    "data": self._identity(self.splits["train"]),
                    "settings": self._settings(),
                    "vocab_size": self.vocab_size_requested,
                    "min_frequency": self.min_frequency,
                    "sample_size": self.tokenizer_sample_size,
                    "tokenizers": tokenizers.__version__,
                    **({"special_tokens": list(self._special_tokens())} if self._special_tokens() else {}),
                }
            )
            tag = f"{self._cache_tag(side)}-{key[:16]}"
            path = self.cache_dir / "tokenizers" / tag / "tokenizer.json"
            lock = self.cache_dir / "tokenizers" / ".locks" / f"{tag}.lock"
            trained[side] = shared_bpe(
                path, key, lock, functools.partial(self._train_tokenizer, columns, path)
            )
        self._set_tokenizers(trained)

    def _train_tokenizer(self, columns: Sequence[str], path: Path | None) -> BPETokenizer:
        train = self.raw_split(self.splits["train"])
        texts, count = prepare.tokenizer_texts(train, columns, self.tokenizer_sample_size)
        whole = count == len(train) * len(columns)
        sampled = "" if whole else f" (a seeded sample of the {len(train)} examples)"
        log.info(
            "Training BPE tokenizer (vocab_size=%d) on %d texts%s%s",
            self.vocab_size_requested,
            count,
            sampled,
            f" -> {path}" if path else "",
        )
        return tokenization.train_bpe(
            texts,
            self.vocab_size_requested,
            min_frequency=self.min_frequency,
            show_progress=self.show_progress,
            length=count,
            extra_special_tokens=self._special_tokens(),
        )

    def _identity(self, split: str) -> dict[str, Any]:
        """What identifies `split`'s raw data: its files (path, size, mtime) or its `datasets` fingerprint."""
        files = self._files(split)
        if files is None:  # generated or hub data: a hash of the content (hub files) and the steps after
            return {"fingerprint": self.raw_split(split)._fingerprint}
        return {"files": [cache.file_identity(path) for path in files]}

    def _cache_tag(self, side: str) -> str:
        return f"{type(self).__name__}-{side}-v{self.vocab_size_requested}"

    def _set_tokenizers(self, tokenizers: Mapping[str, BPETokenizer]) -> None:
        if "joint" in tokenizers:
            self._tokenizers = {"src": tokenizers["joint"], "tgt": tokenizers["joint"]}
        else:
            self._tokenizers = dict(tokenizers)
        self._tokenized.clear()  # ids from an older tokenizer are invalid now

    # -- tokenized splits --------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        """Make ready the splits `stage` needs (None: train, val and test), from the cache when it has them.

        Every rank calls this; with `cache_dir`, one process tokenizes a split and the others wait for it
        and memory-map its files.
        """
        self._ensure_tokenizers()
        every = ("train", "val", "test")
        for role in _STAGE_SPLITS.get(stage, every) if stage else every:
            self.tokenized(self.splits[role])

    def tokenized(self, split: str) -> datasets.Dataset:
        """`split` as token ids plus "id" (row in the raw split); the train split is length-filtered."""
        if split in self._tokenized:
            return self._tokenized[split]
        self._ensure_tokenizers()
        if self.cache_dir is None:
            directory = Path(tempfile.mkdtemp(dir=datasets.fingerprint.get_temporary_cache_files_directory()))
            dataset, meta = self._tokenize(split, directory)
        else:
            tokenizer_digest = hashlib.sha256(
                "".join(t.to_json() for t in self._tokenizers.values()).encode()
            ).hexdigest()
            key = cache.cache_key(
                {
                    "kind": "tokenized",
                    "datamodule": type(self).__name__,
                    "split": split,
                    "train": split == self.splits["train"],  # filtered, not truncated
                    "data": self._identity(split),
                    "settings": self._settings(),
                    "max_len": self.max_len,
                    "tokenizers": tokenizer_digest,
                }
            )
            name = f"{self._cache_tag('joint')}-{split}"
            dataset, meta = cache.load_or_build(
                self.cache_dir / "tokenized", name, key, lambda directory: self._tokenize(split, directory)
            )
            self._restore_meta(meta)
        too_long, raw_rows = meta["too_long"], meta["raw_rows"]
        if too_long and split == self.splits["train"]:
            log.warning(
                "%s: dropped %d of %d examples longer than max_len=%d tokens",
                split,
                too_long,
                raw_rows,
                self.max_len,
            )
        elif too_long:  # evaluation scores every example: cut, keeping the final EOS
            log.warning(
                "%s: truncated %d examples longer than max_len=%d tokens", split, too_long, self.max_len
            )
        self._tokenized[split] = dataset
        return dataset

    def _tokenize(self, split: str, directory: Path) -> tuple[datasets.Dataset, dict[str, Any]]:
        """Tokenize the raw `split` into Arrow files in `directory`; the dataset and what to remember."""
        raw = self.raw_split(split)
        self._check_split(split, raw)
        train = split == self.splits["train"]
        vocab_size = max(tokenizer.vocab_size for tokenizer in self._tokenizers.values())
        joint = corpus_encoder(self._tokenizers["src"])  # one per tokenizer: the same ids, reused chunks
        encoders = {
            side: joint if tokenizer is self._tokenizers["src"] else corpus_encoder(tokenizer)
            for side, tokenizer in self._tokenizers.items()
        }
        dataset, too_long = prepare.tokenize_split(
            raw,
            lambda batch: self._encode(batch, encoders),
            self._text_columns,
            self._id_columns,
            max_len=self.max_len,
            drop_long=train,
            dtype=prepare.ids_dtype(vocab_size),
            directory=directory,
            workers=self._tokenizing_workers(),
            progress=f"Tokenizing {split}" if self.show_progress else None,
        )
        if train and len(dataset) == 0:
            raise sources.DataError(f"split {split!r}: every example is longer than max_len={self.max_len}")
        return dataset, {"too_long": too_long, "raw_rows": len(raw), **self._entry_meta()}

    def _tokenizing_workers(self) -> int:
        """Processes that tokenize a large split: one per core this process may use (README: Performance)."""
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def _check_split(self, split: str, raw: datasets.Dataset) -> None:
        """Raise if `split` cannot be used for training or scoring (classification: unlabeled)."""

    def _trainer_or_none(self) -> L.Trainer | None:
        return self.trainer if getattr(self, "trainer", None) is not None else None

    # -- checkpointing -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The tokenizer JSON(s): with them a checkpoint alone rebuilds the vocabulary."""
        state: dict[str, Any] = {}
        if self._tokenizers:
            if self._tokenizers["src"] is self._tokenizers.get("tgt"):
                state["tokenizers"] = {"joint": self._tokenizers["src"].to_json()}
            else:
                state["tokenizers"] = {side: tok.to_json() for side, tok in self._tokenizers.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the tokenizers (they then win over `cache_dir`)."""
        if "tokenizers" in state_dict:
            self._set_tokenizers(
                {side: tokenizer_from_json(j) for side, j in state_dict["tokenizers"].items()}
            )
