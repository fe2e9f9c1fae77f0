"""LightningDataModules tying sources, BPE tokenizers and token-budget batching together.

`prepare_data` trains (or reuses) the tokenizer(s) under `cache_dir`; `setup` loads raw splits, tokenizes
them with `Dataset.map`, drops over-long training examples and serves loaders of the batch dicts
documented in `data.batching`. `state_dict` carries the tokenizer JSON and the train sampler position,
so a checkpoint alone can rebuild the vocabulary and resume mid-epoch. With `bpe_dropout` the training
sources are re-segmented (BPE-dropout) every epoch, and batched by those lengths.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import datasets
import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from data import sources, synthetic
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
    BPEDropout,
    BPETokenizer,
    bpe_fingerprint,
    load_or_train_bpe,
    train_bpe,
)

log = logging.getLogger(__name__)

_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ()}


class _TokenBudgetDataModule(L.LightningDataModule):
    """What both tasks share: tokenizer caching, length filtering, loaders, sampler state."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
    _text_columns: tuple[str, ...]  # raw columns that are tokenized, e.g. ("src", "tgt")

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
    ) -> None:
        super().__init__()
        if not 0.0 <= bpe_dropout < 1.0:
            raise ValueError(f"bpe_dropout must be in [0, 1), got {bpe_dropout}")
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

    def _tokenizer_corpora(self) -> dict[str, list[str]]:
        """{"src": texts} or {"src": ..., "tgt": ...} (joint: {"joint": texts}) from the train split."""
        raise NotImplementedError

    def _encode(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        raise NotImplementedError

    def _length(self, example_lengths: Mapping[str, list[int]]) -> list[int]:
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
        """Train the tokenizer(s) on the train split, or reuse matching ones from `cache_dir` (rank 0)."""
        if self.cache_dir is not None and not self._tokenizers:
            self._ensure_tokenizers()

    def _ensure_tokenizers(self) -> None:
        if self._tokenizers:
            return
        trained: dict[str, BPETokenizer] = {}
        for side, texts in self._tokenizer_corpora().items():
            settings = {"vocab_size": self.vocab_size_requested, "min_frequency": self.min_frequency}
            if self.cache_dir is None:
                trained[side] = train_bpe(
                    texts, show_progress=self.show_progress, length=len(texts), **settings
                )
                continue
            tag = f"{self._cache_tag(side)}-{bpe_fingerprint(texts, **settings)[:16]}"
            path = self.cache_dir / "tokenizers" / tag / "tokenizer.json"
            trained[side] = load_or_train_bpe(path, texts, show_progress=self.show_progress, **settings)
        self._set_tokenizers(trained)

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
        """Load the splits `stage` needs and tokenize them (every rank)."""
        self._ensure_tokenizers()
        for role in _STAGE_SPLITS.get(stage or "fit", ("train", "val", "test")):
            self.tokenized(self.splits[role])

    def tokenized(self, split: str) -> datasets.Dataset:
        """`split` as token ids plus "id" (row in the raw split); the train split is length-filtered."""
        if split in self._tokenized:
            return self._tokenized[split]
        self._ensure_tokenizers()
        raw = self.raw_split(split)
        self._check_split(split, raw)
        digest = hashlib.sha256("".join(t.to_json() for t in self._tokenizers.values()).encode()).hexdigest()
        with _progress_bars(self.show_progress):
            encoded = raw.map(
                lambda batch, ids: _with_lengths({**self._encode(batch), "id": ids}),
                batched=True,
                with_indices=True,
                remove_columns=list(self._text_columns),
                desc=f"Tokenizing {split}",
                new_fingerprint=f"{raw._fingerprint}-{digest[:16]}",  # a name only: nothing goes to disk
            )
        lengths = {col: encoded[col][:] for col in encoded.column_names if col.endswith("_len")}
        too_long = [
            i for i in range(len(encoded)) if any(lens[i] > self.max_len for lens in lengths.values())
        ]
        if too_long and split == self.splits["train"]:
            keep = sorted(set(range(len(encoded))) - set(too_long))
            log.warning(
                "%s: dropped %d of %d examples longer than max_len=%d tokens",
                split,
                len(too_long),
                len(encoded),
                self.max_len,
            )
            if not keep:
                raise sources.DataError(
                    f"split {split!r}: every example is longer than max_len={self.max_len}"
                )
            encoded = encoded.select(keep)
        elif too_long:
            # Evaluation keeps every example (scores must cover the whole split): cut and re-terminate.
            log.warning(
                "%s: truncated %d examples longer than max_len=%d tokens", split, len(too_long), self.max_len
            )
            with _progress_bars(self.show_progress):
                encoded = encoded.map(
                    lambda batch: _with_lengths(
                        {
                            col: [_truncate(ids, self.max_len) for ids in batch[col]]
                            for col in batch
                            if col.endswith("_ids")
                        }
                    ),
                    batched=True,
                    desc=f"Truncating {split}",
                )
        self._tokenized[split] = encoded
        return encoded

    def _check_split(self, split: str, raw: datasets.Dataset) -> None:
        """Raise if `split` cannot be used for training or scoring (classification: unlabeled)."""

    # -- loaders -------------------------------------------------------------------------------------
    def _lengths(self, dataset: datasets.Dataset, src_len: list[int] | None = None) -> list[int]:
        """Batching lengths of `dataset`'s examples; `src_len` replaces the stored source lengths."""
        lengths = {col: dataset[col][:] for col in dataset.column_names if col.endswith("_len")}
        if src_len is not None:
            lengths["src_len"] = src_len
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
        examples = [{"src_ids": _truncate(seq, self.max_len), "id": i} for i, seq in enumerate(ids)]
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
            i: _truncate(
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


@contextlib.contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """Hide `datasets`' progress bars for one call when `show` is False (restoring the global switch)."""
    if show or not datasets.is_progress_bar_enabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


def _with_lengths(columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Add "<x>_len" next to every "<x>_ids" column (batching then never reads the ids themselves)."""
    for col in [c for c in columns if c.endswith("_ids")]:
        columns[col.removesuffix("_ids") + "_len"] = [len(ids) for ids in columns[col]]
    return columns


def _truncate(ids: Sequence[int], max_len: int) -> list[int]:
    """Cut to `max_len` tokens keeping the final EOS."""
    return list(ids) if len(ids) <= max_len else [*ids[: max_len - 1], ids[-1]]


class TranslationDataModule(_TokenBudgetDataModule):
    """Parallel text -> batches of src, src_padding_mask, tgt_in, tgt_out, tgt_padding_mask, id.

    source: "synthetic" (built-in task, splits train/val/test), "multi30k" (`data_dir` in the official
    `{split}.{lang}.gz` layout, or the hub when `data_dir` is None), "parallel" (`data_dir` with
    `{split}.{lang}` files, plain or .gz) or "hub" (`hub_name`, `hub_config`, `hub_split_names`).
    """

    _text_columns = ("src", "tgt")

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
        )
        if source not in ("synthetic", "multi30k", "parallel", "hub"):
            raise ValueError(f"source must be synthetic, multi30k, parallel or hub, got {source!r}")
        if source == "parallel" and data_dir is None:
            raise ValueError("source='parallel' needs data_dir (a directory of {split}.{lang}[.gz] files)")
        if source == "hub" and not hub_name:
            raise ValueError("source='hub' needs hub_name (a dataset on the HuggingFace hub)")
        if src_lang == tgt_lang:
            raise ValueError(f"src_lang and tgt_lang must differ, both are {src_lang!r}")
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

    def _tokenizer_corpora(self) -> dict[str, list[str]]:
        train = self.raw_split(self.splits["train"])
        if self.joint_vocab:
            return {"joint": train["src"][:] + train["tgt"][:]}
        return {"src": train["src"][:], "tgt": train["tgt"][:]}

    def _cache_tag(self, side: str) -> str:
        langs = (
            f"{self.src_lang}-{self.tgt_lang}"
            if side == "joint"
            else (self.src_lang, self.tgt_lang)[side == "tgt"]
        )
        return f"{self.source}-{langs}-v{self.vocab_size_requested}"

    def _encode(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        return {
            "src_ids": self.src_tokenizer.encode_batch(batch["src"]),
            "tgt_ids": self.tgt_tokenizer.encode_batch(batch["tgt"]),
        }

    def _length(self, lengths: Mapping[str, list[int]]) -> list[int]:
        # tgt_in / tgt_out are one shorter than tgt_ids; the budget bounds both padded tensors.
        return [max(s, t - 1) for s, t in zip(lengths["src_len"], lengths["tgt_len"])]

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

    def _tokenizer_corpora(self) -> dict[str, list[str]]:
        return {"joint": self.raw_split(self.splits["train"])["text"][:]}

    def _cache_tag(self, side: str) -> str:
        return f"{self.source}-{self.text_column}-v{self.vocab_size_requested}"

    def _encode(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        return {"src_ids": self.src_tokenizer.encode_batch(batch["text"])}

    def _length(self, lengths: Mapping[str, list[int]]) -> list[int]:
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
