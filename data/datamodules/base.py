"""The LightningDataModule both tasks share: token-budget loaders over the tokenized splits (`tokenized`),
BPE-dropout, and the train sampler position in the checkpointed state.

Loaders serve the batch dicts documented in `data.batching`. `state_dict` carries the tokenizer JSON and the
train sampler position, so a checkpoint alone can rebuild the vocabulary and resume mid-epoch. With
`bpe_dropout` the training sources are re-segmented (BPE-dropout) every epoch, and batched by those lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import DataLoader

from data import prepare, sources
from data.batching import IndexedBatches, TokenBudgetBatchSampler, pad_sequences, truncate
from data.datamodules.bpe_dropout import EpochSegmentation
from data.datamodules.tokenized import TokenizedDataModule
from data.tokenization import BPETokenizer


class TokenBudgetDataModule(TokenizedDataModule):
    """What both tasks share: tokenizer and tokenized-split caching (`TokenizedDataModule`), length-bucketed
    token-budget loaders, BPE-dropout, sampler state."""

    # set by the loaders and `load_state_dict`
    _train_sampler: TokenBudgetBatchSampler | None = None
    _pending_sampler_state: dict[str, int] | None = None
    _segmentation: EpochSegmentation | None = None  # bpe_dropout: the training sources per epoch

    # -- hooks for the subclasses ------------------------------------------------------------------
    def _length(self, example_lengths: Mapping[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def _collator(self) -> Callable[[Sequence[Mapping[str, Any]]], dict[str, torch.Tensor]]:
        raise NotImplementedError

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
        self._train_sampler = self._train_batch_sampler(
            dataset,
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

    def _train_batch_sampler(self, dataset: datasets.Dataset, **settings: Any) -> TokenBudgetBatchSampler:
        """The training sampler over `dataset` with the loader's `settings` (several pairs: over them)."""
        return TokenBudgetBatchSampler(self._lengths(dataset), self.max_tokens, **settings)

    def _eval_loader(self, split: str) -> DataLoader:
        dataset = self.tokenized(split)
        # Sorted by length: fast and deterministic; the "id" column restores file order. Under DDP each
        # rank takes every world_size-th batch of that list, none repeated (the tasks gather by "id").
        trainer = self._trainer_or_none()
        sampler = TokenBudgetBatchSampler(
            self._lengths(dataset),
            self.eval_max_tokens,
            shuffle=False,
            num_replicas=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
            even_batches=False,
        )
        return self._loader(dataset, sampler)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.splits["val"])

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.splits["test"])

    def predict_dataloader(self) -> DataLoader:
        """Batches (src, src_padding_mask, id) of `predict_texts`, by default the test split's sources."""
        texts = self.predict_texts if self.predict_texts is not None else self.sources(self.splits["test"])
        return self.text_dataloader(texts)

    def text_dataloader(self, texts: Sequence[str]) -> DataLoader:
        """Batches (src, src_padding_mask, id) of source `texts` (id: the index in `texts`), in the
        evaluation token budget; what evaluate.py translates and distillation's teachers decode."""
        if not texts:
            raise sources.DataError("nothing to predict: predict_texts is empty")
        ids = self.src_tokenizer.encode_batch(list(texts))
        examples = [{"src_ids": truncate(seq, self.max_len), "id": i} for i, seq in enumerate(ids)]
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
        """Every training source of `epoch` with BPE-dropout, by example id (see `EpochSegmentation`)."""
        if self._segmentation is None:
            train = self.splits["train"]
            self._segmentation = EpochSegmentation(
                self.src_tokenizer,
                self.bpe_dropout,
                self.raw_split(train)[self._text_columns[0]],
                self.tokenized(train)["id"],  # in dataset order, which _epoch_lengths relies on
                seed=self.seed,
                max_len=self.max_len,
            )
        return self._segmentation.sources(epoch)

    def _epoch_lengths(self, epoch: int) -> list[int]:
        """Batching lengths of the training examples (in dataset order) with `epoch`'s sources."""
        segmented = self._segmented_sources(epoch)
        return self._lengths(self.tokenized(self.splits["train"]), [len(ids) for ids in segmented.values()])

    def _set_tokenizers(self, tokenizers: Mapping[str, BPETokenizer]) -> None:
        super()._set_tokenizers(tokenizers)
        self._segmentation = None  # segmented with the older tokenizer

    # -- checkpointing -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Tokenizer JSON(s) and the train sampler position (batches consumed in the current epoch)."""
        state = super().state_dict()
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
        super().load_state_dict(state_dict)
        if "train_sampler" in state_dict:
            if self._train_sampler is not None:
                self._train_sampler.load_state_dict(state_dict["train_sampler"])
            else:
                self._pending_sampler_state = dict(state_dict["train_sampler"])
