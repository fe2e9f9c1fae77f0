"""LightningDataModules tying sources, BPE tokenizers and token-budget batching together.

`prepare_data` trains (or reuses) the tokenizer(s) under `cache_dir`; `setup` tokenizes the splits a
stage needs (dropping over-long training examples) into Arrow files under `cache_dir` (`data.cache`),
or memory-maps them from there when a process already did, and serves loaders of the batch dicts
documented in `data.batching`. `state_dict` carries the tokenizer JSON and the train sampler position,
so a checkpoint alone can rebuild the vocabulary and resume mid-epoch. With `bpe_dropout` the training
sources are re-segmented (BPE-dropout) every epoch, and batched by those lengths.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import datasets
import lightning as L
import numpy as np
import tokenizers
import torch
from torch.utils.data import DataLoader

from data import cache, prepare, sources, synthetic
from data.batching import (
    ClassificationCollator,
    IndexedBatches,
    TokenBudgetBatchSampler,
    TranslationCollator,
    pad_sequences,
)
from data.tokenization import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    BPEDropout,
    BPETokenizer,
    CorpusEncoder,
    load_bpe,
    save_bpe,
    train_bpe,
)

log = logging.getLogger(__name__)

_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ()}
TOKENIZER_SAMPLE_SIZE = 1_000_000  # training examples a tokenizer learns from (more: a seeded sample)


class _TokenBudgetDataModule(L.LightningDataModule):
    """What both tasks share: tokenizer and tokenized-split caching, length filtering, loaders, sampler
    state."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
    _text_columns: tuple[str, ...]  # raw columns that are tokenized, e.g. ("src", "tgt")
    _id_columns: tuple[str, ...]  # the token-id columns `_encode` returns, e.g. ("src_ids", "tgt_ids")

    def __init__(
        self,
        *,
        train_split: str,
        val_split: str,
        test_split: str,
        vocab_size: int,
        min_frequency: int,
        max_tokens: int,
        eval_max_tokens: int | None,
        max_len: int,
        pool_size: int | None,
        max_sentences: int | None,
        num_workers: int,
        cache_dir: str | Path | None,
        seed: int,
        show_progress: bool,
        bpe_dropout: float = 0.0,
        tokenizer_sample_size: int | None = TOKENIZER_SAMPLE_SIZE,
    ) -> None:
        super().__init__()
        if tokenizer_sample_size is not None and tokenizer_sample_size < 1:
            raise ValueError(f"tokenizer_sample_size must be >= 1 or null, got {tokenizer_sample_size}")
        if not 0.0 <= bpe_dropout < 1.0:
            raise ValueError(f"bpe_dropout must be in [0, 1), got {bpe_dropout}")
        if vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens {list(SPECIAL_TOKENS)}, "
                f"got {vocab_size}"
            )
        for name, value, low in (("min_frequency", min_frequency, 0), ("seed", seed, 0)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        for name, value in (("pool_size", pool_size), ("max_sentences", max_sentences)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or null, got {value}")
        if max_len < 3:
            raise ValueError(f"max_len must leave room for BOS, EOS and a token, got {max_len}")
        if max_tokens < max_len:
            raise ValueError(
                f"max_tokens ({max_tokens}) must be at least max_len ({max_len}): one example must fit"
            )
        if eval_max_tokens is not None and eval_max_tokens < max_len:
            raise ValueError(
                f"eval_max_tokens ({eval_max_tokens}) must be at least max_len ({max_len}): "
                "one example must fit"
            )
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.splits = {"train": train_split, "val": val_split, "test": test_split}
        self.vocab_size_requested = vocab_size
        self.min_frequency = min_frequency
        self.max_tokens = max_tokens
        self.eval_max_tokens = eval_max_tokens or max_tokens
        self.max_len = max_len
        self.pool_size = pool_size
        self.max_sentences = max_sentences
        self.num_workers = num_workers
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        self.seed = seed
        self.show_progress = show_progress
        self.bpe_dropout = bpe_dropout
        self.tokenizer_sample_size = tokenizer_sample_size
        self.predict_texts: list[str] | None = None  # set by evaluate.py to decode arbitrary text
        self._raw: dict[str, datasets.Dataset] = {}
        self._tokenized: dict[str, datasets.Dataset] = {}
        self._tokenizers: dict[str, BPETokenizer] = {}  # "src" and "tgt" (same object when joint)
        self._train_sampler: TokenBudgetBatchSampler | None = None
        self._pending_sampler_state: dict[str, int] | None = None
        # bpe_dropout: the segmenter with the training rows' words, and one epoch's segmented sources
        self._resegmenter: tuple[BPEDropout, list[list[str]]] | None = None
        self._resegmented: tuple[int, dict[int, list[int]]] | None = None

    # -- hooks for the subclasses ------------------------------------------------------------------
    def _load_raw(self, splits: Sequence[str]) -> datasets.DatasetDict:
        raise NotImplementedError

    def _tokenizer_columns(self) -> dict[str, list[str]]:
        """Raw columns each tokenizer learns from: {"joint": [...]} or {"src": [...], "tgt": [...]}."""
        raise NotImplementedError

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

    def _length(self, example_lengths: Mapping[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def _collator(self) -> Callable[[Sequence[Mapping[str, Any]]], dict[str, torch.Tensor]]:
        raise NotImplementedError

    # -- raw splits --------------------------------------------------------------------------------
    def raw_split(self, split: str) -> datasets.Dataset:
        """The raw split by name (loaded once; ids index its rows)."""
        if split not in self._raw:
            self._raw.update(self._load_raw([split]))
        return self._raw[split]

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
                }
            )
            tag = f"{self._cache_tag(side)}-{key[:16]}"
            path = self.cache_dir / "tokenizers" / tag / "tokenizer.json"
            tokenizer = load_bpe(path, key)
            if tokenizer is None:
                with cache.locked(self.cache_dir / "tokenizers" / ".locks" / f"{tag}.lock"):
                    tokenizer = load_bpe(path, key)  # trained by another process while this one waited
                    if tokenizer is None:
                        tokenizer = self._train_tokenizer(columns, path)
                        try:
                            save_bpe(tokenizer, path, key)
                        except OSError as err:  # e.g. a full disk
                            raise sources.DataError(f"cannot write {path}: {err.strerror or err}") from err
            trained[side] = tokenizer
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
        return train_bpe(
            texts,
            self.vocab_size_requested,
            min_frequency=self.min_frequency,
            show_progress=self.show_progress,
            length=count,
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
        self._resegmenter, self._resegmented = None, None

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
        joint = CorpusEncoder(self._tokenizers["src"])  # one per tokenizer: the same ids, reused chunks
        encoders = {
            side: joint if tokenizer is joint.tokenizer else CorpusEncoder(tokenizer)
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

    # -- loaders -------------------------------------------------------------------------------------
    def _lengths(self, dataset: datasets.Dataset, src_len: list[int] | None = None) -> np.ndarray:
        """Batching lengths of `dataset`'s examples; `src_len` replaces the stored source lengths."""
        lengths = {
            col: prepare.length_array(dataset, col) for col in dataset.column_names if col.endswith("_len")
        }
        if src_len is not None:
            lengths["src_len"] = np.asarray(src_len, dtype=np.int64)
        return self._length(lengths)

    def _loader(self, examples: Any, sampler: TokenBudgetBatchSampler) -> DataLoader:
        return DataLoader(
            IndexedBatches(examples, sampler.batches()),  # whole batches for overfit_batches too
            sampler=sampler,
            batch_size=None,  # the sampler yields whole batches of indices
            collate_fn=self._collator(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            # its own generator: creating an iterator then draws nothing from the global RNG, which
            # dropout uses, so a run resumed mid-epoch draws the same dropout masks (exact resume)
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_dataloader(self) -> DataLoader:
        dataset = self.tokenized(self.splits["train"])
        trainer = self._trainer_or_none()
        self._train_sampler = TokenBudgetBatchSampler(
            self._lengths(dataset),
            self.max_tokens,
            shuffle=True,
            seed=self.seed,
            pool_size=self.pool_size,
            num_replicas=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
            max_sentences=self.max_sentences,
            epoch_lengths=self._epoch_lengths if self.bpe_dropout else None,
        )
        if self._pending_sampler_state is not None:
            self._train_sampler.load_state_dict(self._pending_sampler_state)
            self._pending_sampler_state = None
        return self._loader(dataset, self._train_sampler)

    def _eval_loader(self, split: str) -> DataLoader:
        dataset = self.tokenized(split)
        # Sorted by length: fast and deterministic; the "id" column restores file order.
        sampler = TokenBudgetBatchSampler(self._lengths(dataset), self.eval_max_tokens, shuffle=False)
        return self._loader(dataset, sampler)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.splits["val"])

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.splits["test"])

    def predict_dataloader(self) -> DataLoader:
        """Batches (src, src_padding_mask, id) of `predict_texts`, by default the test split's sources."""
        texts = self.predict_texts if self.predict_texts is not None else self.sources(self.splits["test"])
        if not texts:
            raise sources.DataError("nothing to predict: predict_texts is empty")
        ids = self.src_tokenizer.encode_batch(list(texts))
        examples = [{"src_ids": prepare.truncate(seq, self.max_len), "id": i} for i, seq in enumerate(ids)]
        sampler = TokenBudgetBatchSampler(
            [len(ex["src_ids"]) for ex in examples], self.eval_max_tokens, shuffle=False
        )
        return self._loader(examples, sampler)

    # -- BPE-dropout ---------------------------------------------------------------------------------
    def on_before_batch_transfer(self, batch: dict[str, Any], dataloader_idx: int) -> dict[str, Any]:
        """With `bpe_dropout`, a training batch gets its sources in this epoch's segmentation."""
        trainer = self._trainer_or_none()
        if not self.bpe_dropout or trainer is None or not trainer.training or self._train_sampler is None:
            return batch
        segmented = self._segmented_sources(self._train_sampler.epoch)
        src = pad_sequences([segmented[i] for i in batch["id"].tolist()], self.pad_id)  # (B, S)
        return {**batch, "src": src, "src_padding_mask": src == self.pad_id}

    def _segmented_sources(self, epoch: int) -> dict[int, list[int]]:
        """Every training source of `epoch` with BPE-dropout, by example id (the current epoch is kept).

        Example `id` of epoch `e` is drawn from a generator seeded with (seed, e, id): the same split
        whatever the batches, workers or restarts. The train sampler packs the epoch by these lengths.
        """
        if self._resegmented is not None and self._resegmented[0] == epoch:
            return self._resegmented[1]
        if self._resegmenter is None:
            segmenter = BPEDropout(self.src_tokenizer, self.bpe_dropout)
            texts = self.raw_split(self.splits["train"])[self._text_columns[0]]
            self._resegmenter = (segmenter, [segmenter.words(text) for text in texts])
        segmenter, words = self._resegmenter
        segmented = {  # in dataset order, which _epoch_lengths relies on
            i: prepare.truncate(
                segmenter.encode_words(words[i], np.random.default_rng([self.seed, epoch, i])), self.max_len
            )
            for i in self.tokenized(self.splits["train"])["id"]
        }
        self._resegmented = (epoch, segmented)
        return segmented

    def _epoch_lengths(self, epoch: int) -> list[int]:
        """Batching lengths of the training examples (in dataset order) with `epoch`'s sources."""
        segmented = self._segmented_sources(epoch)
        return self._lengths(self.tokenized(self.splits["train"]), [len(ids) for ids in segmented.values()])

    def _trainer_or_none(self) -> L.Trainer | None:
        return self.trainer if getattr(self, "trainer", None) is not None else None

    # -- checkpointing -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Tokenizer JSON(s) and the train sampler position (batches consumed in the current epoch)."""
        state: dict[str, Any] = {}
        if self._tokenizers:
            if self._tokenizers["src"] is self._tokenizers.get("tgt"):
                state["tokenizers"] = {"joint": self._tokenizers["src"].to_json()}
            else:
                state["tokenizers"] = {side: tok.to_json() for side, tok in self._tokenizers.items()}
        if self._train_sampler is not None:
            sampler_state = self._train_sampler.state_dict()
            trainer = self._trainer_or_none()
            if trainer is not None and trainer.state.fn == "fit":
                # The loader fetches ahead of training; count what the loop actually trained on.
                sampler_state["batches_yielded"] = (
                    trainer.fit_loop.epoch_loop.batch_progress.current.processed
                )
            state["train_sampler"] = sampler_state
        elif self._pending_sampler_state is not None:
            state["train_sampler"] = dict(self._pending_sampler_state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the tokenizers (they then win over `cache_dir`) and the train sampler position."""
        if "tokenizers" in state_dict:
            self._set_tokenizers(
                {side: BPETokenizer.from_json(j) for side, j in state_dict["tokenizers"].items()}
            )
        if "train_sampler" in state_dict:
            if self._train_sampler is not None:
                self._train_sampler.load_state_dict(state_dict["train_sampler"])
            else:
                self._pending_sampler_state = dict(state_dict["train_sampler"])


class TranslationDataModule(_TokenBudgetDataModule):
    """Parallel text -> batches of src, src_padding_mask, tgt_in, tgt_out, tgt_padding_mask, id.

    source: "synthetic" (built-in task, splits train/val/test), "multi30k" (`data_dir` in the official
    `{split}.{lang}.gz` layout, or the hub when `data_dir` is None), "parallel" (`data_dir` with
    `{split}.{lang}` files, plain or .gz) or "hub" (`hub_name`, `hub_config`, `hub_split_names`).
    """

    _text_columns = ("src", "tgt")
    _id_columns = ("src_ids", "tgt_ids")

    def __init__(
        self,
        source: Literal["synthetic", "multi30k", "parallel", "hub"] = "synthetic",
        data_dir: str | Path | None = None,
        src_lang: str = "en",
        tgt_lang: str = "de",
        train_split: str = "train",
        val_split: str = "val",
        test_split: str = "test",
        hub_name: str | None = None,
        hub_config: str | None = None,
        hub_split_names: Mapping[str, str] | None = None,
        synthetic_sizes: Mapping[str, int] | None = None,
        vocab_size: int = 8000,
        joint_vocab: bool = True,
        min_frequency: int = 2,
        max_tokens: int = 4096,
        eval_max_tokens: int | None = None,
        max_len: int = 256,
        pool_size: int | None = None,
        max_sentences: int | None = None,
        num_workers: int = 0,
        cache_dir: str | Path | None = None,
        seed: int = 0,
        show_progress: bool = True,
        bpe_dropout: float = 0.0,
        tokenizer_sample_size: int | None = TOKENIZER_SAMPLE_SIZE,
    ) -> None:
        super().__init__(
            train_split=train_split,
            val_split=val_split,
            test_split=test_split,
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            max_tokens=max_tokens,
            eval_max_tokens=eval_max_tokens,
            max_len=max_len,
            pool_size=pool_size,
            max_sentences=max_sentences,
            num_workers=num_workers,
            cache_dir=cache_dir,
            seed=seed,
            show_progress=show_progress,
            bpe_dropout=bpe_dropout,
            tokenizer_sample_size=tokenizer_sample_size,
        )
        if source not in ("synthetic", "multi30k", "parallel", "hub"):
            raise ValueError(f"source must be synthetic, multi30k, parallel or hub, got {source!r}")
        if source == "parallel" and data_dir is None:
            raise ValueError("source='parallel' needs data_dir (a directory of {split}.{lang}[.gz] files)")
        if source == "hub" and not hub_name:
            raise ValueError("source='hub' needs hub_name (a dataset on the HuggingFace hub)")
        if src_lang == tgt_lang:
            raise ValueError(f"src_lang and tgt_lang must differ, both are {src_lang!r}")
        for split, size in (synthetic_sizes or {}).items():
            if size < 1:
                raise ValueError(f"synthetic_sizes.{split} must be >= 1, got {size}")
        self.source, self.data_dir = source, data_dir
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.hub_name, self.hub_config = hub_name, hub_config
        self.hub_split_names = dict(hub_split_names or {})
        self.synthetic_sizes = None if synthetic_sizes is None else dict(synthetic_sizes)
        self.joint_vocab = joint_vocab

    def _load_raw(self, splits: Sequence[str]) -> datasets.DatasetDict:
        if self.source == "synthetic":
            # Generating one split draws the others too (they are disjoint): keep them all.
            everything = list(dict.fromkeys([*splits, *(self.synthetic_sizes or synthetic.DEFAULT_SIZES)]))
            return sources.load_synthetic(everything, seed=self.seed, sizes=self.synthetic_sizes)
        if self.source == "multi30k":
            return sources.load_multi30k(self.data_dir, splits, self.src_lang, self.tgt_lang)
        if self.source == "parallel":
            return sources.load_parallel_dir(
                self.data_dir, splits, self.src_lang, self.tgt_lang, "{split}.{lang}"
            )
        return sources.load_translation_hub(
            self.hub_name, splits, self.src_lang, self.tgt_lang, self.hub_config, self.hub_split_names
        )

    def _tokenizer_columns(self) -> dict[str, list[str]]:
        # joint: every source, then every target, as the vocabulary has always been trained
        return {"joint": ["src", "tgt"]} if self.joint_vocab else {"src": ["src"], "tgt": ["tgt"]}

    def _files(self, split: str) -> list[Path] | None:
        if self.source == "multi30k" and self.data_dir is not None:
            layout = sources.MULTI30K_LAYOUT
        elif self.source == "parallel":
            layout = "{split}.{lang}"
        else:
            return None
        return list(sources.parallel_files(self.data_dir, split, self.src_lang, self.tgt_lang, layout))

    def _settings(self) -> dict[str, Any]:
        return {"source": self.source, "src_lang": self.src_lang, "tgt_lang": self.tgt_lang}

    def _cache_tag(self, side: str) -> str:
        langs = (
            f"{self.src_lang}-{self.tgt_lang}"
            if side == "joint"
            else (self.src_lang, self.tgt_lang)[side == "tgt"]
        )
        return f"{self.source}-{langs}-v{self.vocab_size_requested}"

    def _encode(
        self, batch: Mapping[str, list[Any]], encoders: Mapping[str, CorpusEncoder]
    ) -> dict[str, list[Any]]:
        return {
            "src_ids": encoders["src"].encode_batch(batch["src"]),
            "tgt_ids": encoders["tgt"].encode_batch(batch["tgt"]),
        }

    def _length(self, lengths: Mapping[str, np.ndarray]) -> np.ndarray:
        # tgt_in / tgt_out are one shorter than tgt_ids; the budget bounds both padded tensors.
        return np.maximum(lengths["src_len"], lengths["tgt_len"] - 1)

    def _collator(self) -> TranslationCollator:
        return TranslationCollator(self.pad_id)

    @property
    def tgt_tokenizer(self) -> BPETokenizer:
        return self._tokenizer("tgt")

    @property
    def src_vocab_size(self) -> int:
        return self.src_tokenizer.vocab_size

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt_tokenizer.vocab_size

    def sources(self, split: str) -> list[str]:
        """Raw source sentences of `split`, indexed by the batches' `id`."""
        return self.raw_split(split)["src"][:]

    def references(self, split: str) -> list[str]:
        """Raw target sentences of `split` (detokenized references for sacreBLEU), indexed by `id`."""
        return self.raw_split(split)["tgt"][:]


class ClassificationDataModule(_TokenBudgetDataModule):
    """Labelled text -> batches of src, src_padding_mask, label, id.

    source: "sst2" (`data_dir` in the GLUE layout `{split}.tsv[.gz]`, or the hub when None), "files"
    (`data_dir` with files named `file_pattern`, TSV/CSV with a header or JSONL, plain or .gz) or
    "hub" (`hub_name`, `hub_config`, `hub_split_names`). Unlabeled splits (all -1) are refused for
    validation and testing but can be predicted.
    """

    _text_columns = ("text",)
    _id_columns = ("src_ids",)

    def __init__(
        self,
        source: Literal["sst2", "files", "hub"] = "sst2",
        data_dir: str | Path | None = None,
        train_split: str = "train",
        val_split: str = "dev",
        test_split: str = "test",
        file_pattern: str = "{split}.tsv",
        text_column: str = "sentence",
        label_column: str = "label",
        label_names: Sequence[str] | None = None,
        hub_name: str | None = None,
        hub_config: str | None = None,
        hub_split_names: Mapping[str, str] | None = None,
        vocab_size: int = 8000,
        min_frequency: int = 2,
        max_tokens: int = 4096,
        eval_max_tokens: int | None = None,
        max_len: int = 128,
        pool_size: int | None = None,
        max_sentences: int | None = None,
        num_workers: int = 0,
        cache_dir: str | Path | None = None,
        seed: int = 0,
        show_progress: bool = True,
        bpe_dropout: float = 0.0,
        tokenizer_sample_size: int | None = TOKENIZER_SAMPLE_SIZE,
    ) -> None:
        super().__init__(
            train_split=train_split,
            val_split=val_split,
            test_split=test_split,
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            max_tokens=max_tokens,
            eval_max_tokens=eval_max_tokens,
            max_len=max_len,
            pool_size=pool_size,
            max_sentences=max_sentences,
            num_workers=num_workers,
            cache_dir=cache_dir,
            seed=seed,
            show_progress=show_progress,
            bpe_dropout=bpe_dropout,
            tokenizer_sample_size=tokenizer_sample_size,
        )
        if source not in ("sst2", "files", "hub"):
            raise ValueError(f"source must be sst2, files or hub, got {source!r}")
        if source == "files" and data_dir is None:
            raise ValueError(f"source='files' needs data_dir (a directory of {file_pattern} files)")
        if source == "hub" and not hub_name:
            raise ValueError("source='hub' needs hub_name (a dataset on the HuggingFace hub)")
        if "{split}" not in file_pattern:
            raise ValueError(f"file_pattern must contain '{{split}}', got {file_pattern!r}")
        self.source, self.data_dir, self.file_pattern = source, data_dir, file_pattern
        self.text_column, self.label_column = text_column, label_column
        self.label_names = None if label_names is None else [str(name) for name in label_names]
        self.hub_name, self.hub_config = hub_name, hub_config
        self.hub_split_names = dict(hub_split_names or {})
        self._class_names: list[str] | None = self.label_names

    def _load_raw(self, splits: Sequence[str]) -> datasets.DatasetDict:
        if self.source == "sst2":
            loaded = sources.load_sst2(self.data_dir, splits)
        elif self.source == "hub":
            loaded = sources.load_classification_hub(
                self.hub_name,
                splits,
                self.text_column,
                self.label_column,
                self.hub_config,
                self.hub_split_names,
            )
        else:
            train = self.splits["train"]
            wanted = list(splits)
            if self._class_names is None and train not in wanted:
                wanted.append(train)  # the label set is inferred from the training split
            files = {split: self._file(split) for split in wanted}
            loaded = sources.load_classification_files(
                files, self.text_column, self.label_column, self._class_names, infer_from=train
            )
        names = loaded[next(iter(loaded))].features["label"].names
        if self._class_names is not None and list(names) != self._class_names:
            raise sources.DataError(
                f"splits {list(splits)} have classes {names}, expected {self._class_names}"
            )
        self._class_names = list(names)
        return loaded

    def _file(self, split: str) -> Path:
        directory = Path(self.data_dir).expanduser()
        name = self.file_pattern.format(split=split)
        if not directory.is_dir():
            raise sources.DataError(
                f"data directory {directory} does not exist (expected files named {self.file_pattern})"
            )
        for candidate in (directory / name, directory / f"{name}.gz"):
            if candidate.is_file():
                return candidate
        present = sorted(p.name for p in directory.iterdir())
        raise sources.DataError(
            f"missing {directory / name}: expected files named {self.file_pattern} (plain or .gz); "
            f"files present: {present or 'none'}"
        )

    def _check_split(self, split: str, raw: datasets.Dataset) -> None:
        # Tokenized splits are trained on or scored; unlabeled text goes through predict_dataloader.
        sources.check_labeled(raw, split)

    def _tokenizer_columns(self) -> dict[str, list[str]]:
        return {"joint": ["text"]}

    def _files(self, split: str) -> list[Path] | None:
        if self.source == "sst2" and self.data_dir is not None:
            return [sources.sst2_file(self.data_dir, split)]
        if self.source != "files":
            return None
        train = self.splits["train"]
        inferred = self.label_names is None and split != train  # its label ids come from the train file
        return [self._file(split)] + ([self._file(train)] if inferred else [])

    def _settings(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "text_column": self.text_column,
            "label_column": self.label_column,
            "label_names": self.label_names,
        }

    def _entry_meta(self) -> dict[str, Any]:
        return {"class_names": self.class_names}

    def _restore_meta(self, meta: Mapping[str, Any]) -> None:
        names = list(meta["class_names"])
        if self._class_names is not None and names != self._class_names:
            raise sources.DataError(f"the cached splits have classes {names}, expected {self._class_names}")
        self._class_names = names

    def _cache_tag(self, side: str) -> str:
        return f"{self.source}-{self.text_column}-v{self.vocab_size_requested}"

    def _encode(
        self, batch: Mapping[str, list[Any]], encoders: Mapping[str, CorpusEncoder]
    ) -> dict[str, list[Any]]:
        return {"src_ids": encoders["src"].encode_batch(batch["text"])}

    def _length(self, lengths: Mapping[str, np.ndarray]) -> np.ndarray:
        return lengths["src_len"]

    def _collator(self) -> ClassificationCollator:
        return ClassificationCollator(self.pad_id)

    @property
    def tokenizer(self) -> BPETokenizer:
        return self.src_tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def class_names(self) -> list[str]:
        if self._class_names is None:
            self.raw_split(self.splits["train"])
        assert self._class_names is not None  # set by _load_raw
        return list(self._class_names)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def sources(self, split: str) -> list[str]:
        """Raw texts of `split`, indexed by the batches' `id`."""
        return self.raw_split(split)["text"][:]

    def labels(self, split: str) -> list[int]:
        """Gold label indices of `split` (-1 = unlabeled), indexed by `id`."""
        return self.raw_split(split)["label"][:]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._class_names is not None:
            state["class_names"] = list(self._class_names)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "class_names" in state_dict:
            self._class_names = list(state_dict["class_names"])
