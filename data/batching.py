"""Token-budget batches with length bucketing (DDP-aware, resumable) and collates into padded tensors.

A batch costs (number of examples) x (longest example), i.e. the tokens of its padded tensor, and
never exceeds `max_tokens`. For translation the length of an example is max(source, target input)
length, so the budget bounds the padded `src` and the padded `tgt_in`/`tgt_out` tensors each.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DistributedSampler

from data.tokenization import PAD_ID

log = logging.getLogger(__name__)


class BatchList(Sequence[list[int]]):
    """Batches as slices of one index array: batch b is `order[bounds[b]:bounds[b + 1]]`, and the list
    holds the batches `picks` (a shuffled, repeated or per-rank selection). Items are lists of ints; no
    Python object per example is kept, so millions of examples cost a few arrays.
    """

    def __init__(self, order: np.ndarray, bounds: np.ndarray, picks: np.ndarray | None = None) -> None:
        self.order, self.bounds = order, bounds
        self.picks = np.arange(len(bounds) - 1) if picks is None else picks

    def __len__(self) -> int:
        return len(self.picks)

    @overload
    def __getitem__(self, index: int) -> list[int]: ...

    @overload
    def __getitem__(self, index: slice) -> BatchList: ...

    def __getitem__(self, index: int | slice) -> list[int] | BatchList:
        if isinstance(index, slice):
            return BatchList(self.order, self.bounds, self.picks[index])
        batch = self.picks[index]
        return self.order[self.bounds[batch] : self.bounds[batch + 1]].tolist()

    def select(self, positions: np.ndarray) -> BatchList:
        """The batches at `positions` of this list, in that order (repeats allowed)."""
        return BatchList(self.order, self.bounds, self.picks[positions])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-sequence semantics: equal by content


class TokenBudgetBatchSampler(DistributedSampler):
    """Yields lists of example indices whose padded size fits `max_tokens` (cf. paper §5.1 batching).

    shuffle=True: each epoch permutes the examples with seed+epoch, sorts them by length within pools
    of `pool_size` (None = one pool: the batch count is then the same every epoch), packs batches
    greedily and shuffles the batches. shuffle=False: all examples sorted by length (ties by index),
    batches in that order: deterministic, for evaluation.

    With several replicas every rank computes the same batch list and takes every `num_replicas`-th
    batch; the list is first padded by repeating its first batches (or cut, with drop_last) so that all
    ranks get the same count. `even_batches=False` (evaluation under DDP) repeats and drops nothing: the
    ranks' counts may differ by one, which only a loop without a collective per step tolerates
    (validation, test); a list with fewer batches than ranks has its largest batches halved first, and a
    rank still left without one (fewer examples than ranks) repeats the last batch (`repeats_another_rank`
    says so: the tasks leave it out of their metrics). It subclasses
    `DistributedSampler` so that Lightning calls `set_epoch` and never wraps it; pass it as
    `DataLoader(dataset, sampler=..., batch_size=None)` (the dataset is then indexed with a list of
    indices) or as `batch_sampler=`.

    `epoch_lengths(epoch)`, when given, replaces `lengths` in that epoch: for examples whose
    tokens change every epoch (BPE-dropout), so that the budget holds for what is actually batched.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        pool_size: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        max_sentences: int | None = None,
        epoch_lengths: Callable[[int], Sequence[int]] | None = None,
        even_batches: bool = True,
    ) -> None:
        self.lengths = _compact(np.asarray(lengths, dtype=np.int64))
        self.epoch_lengths = epoch_lengths
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            raise ValueError(f"lengths must be a non-empty 1-d sequence, got shape {self.lengths.shape}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        longest = int(self.lengths.argmax())
        if self.lengths[longest] > max_tokens:
            raise ValueError(
                f"max_tokens={max_tokens} is smaller than example {longest} of length "
                f"{self.lengths[longest]}: every example must fit in a batch"
            )
        if pool_size is not None and pool_size < 1:
            raise ValueError(f"pool_size must be positive or None, got {pool_size}")
        if max_sentences is not None and max_sentences < 1:
            raise ValueError(f"max_sentences must be positive or None, got {max_sentences}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        # Not DistributedSampler.__init__: it wants a dataset and torch.distributed; these are its fields.
        self.num_replicas, self.rank, self.shuffle, self.seed, self.drop_last = (
            num_replicas,
            rank,
            shuffle,
            seed,
            drop_last,
        )
        self.max_tokens, self.pool_size, self.max_sentences = max_tokens, pool_size, max_sentences
        self.even_batches = even_batches
        self.epoch = 0
        self._resume_from = 0  # batches of `self.epoch` already consumed before a restart
        self._yielded = 0  # batches of `self.epoch` handed out by the current/last iterator
        self._cache: tuple[int, BatchList] | None = None
        self._repeats = False  # this rank's batches are another rank's again (see `repeats_another_rank`)

    # -- the batches of one epoch ------------------------------------------------------------------
    def _lengths_of(self, epoch: int) -> np.ndarray:
        """`lengths`, or what `epoch_lengths` gives for `epoch` (examples re-segmented every epoch)."""
        if self.epoch_lengths is None:
            return self.lengths
        lengths = _compact(np.asarray(self.epoch_lengths(epoch), dtype=np.int64))
        if lengths.shape != self.lengths.shape or lengths.max() > self.max_tokens:
            raise ValueError(
                f"epoch_lengths({epoch}) must give {len(self.lengths)} lengths of at most "
                f"max_tokens={self.max_tokens}, got shape {lengths.shape}, longest {lengths.max()}"
            )
        return lengths

    def _all_batches(self, epoch: int) -> BatchList:
        """Every rank's batches of `epoch`, in order, before splitting across ranks."""
        lengths = self._lengths_of(epoch)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(len(lengths))
            pool = self.pool_size or len(order)
            # Stable sort inside each pool: ties keep the random order, so batches differ per epoch.
            if pool >= len(order):
                order = order[np.argsort(lengths[order], kind="stable")]
            else:
                pools = [order[i : i + pool] for i in range(0, len(order), pool)]
                order = np.concatenate([p[np.argsort(lengths[p], kind="stable")] for p in pools])
        else:
            order = np.argsort(lengths, kind="stable")
        batches = self._pack(order, lengths)
        if self.shuffle:
            batches = batches.select(rng.permutation(len(batches)))
        return batches

    def _pack(self, order: np.ndarray, lengths: np.ndarray) -> BatchList:
        """Greedy, in `order`: add examples while (count + 1) x longest still fits the budget (and the cap).

        One NumPy step per batch instead of a Python step per example: a batch starting at example s
        holds at most max_tokens // length(s) examples; within that window, count x running maximum is the
        padded size of every candidate batch. It only grows, so the batch ends where it first exceeds
        the budget.
        """
        ordered = lengths[order]
        total = len(ordered)
        cap = min(self.max_sentences or total, total)
        starts = []
        start = 0
        while start < total:
            window = min(self.max_tokens // max(int(ordered[start]), 1), cap, total - start)
            longest = np.maximum.accumulate(ordered[start : start + window]).astype(np.int64)
            size = int(np.count_nonzero(longest * np.arange(1, window + 1) <= self.max_tokens))
            starts.append(start)
            start += size
        starts.append(total)
        return BatchList(order, np.asarray(starts, dtype=np.int64))

    def batches(self, epoch: int | None = None) -> BatchList:
        """This rank's batches for `epoch` (default: the current one), whole epoch, no resume offset."""
        epoch = self.epoch if epoch is None else epoch
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        batches = self._all_batches(epoch)
        if self.num_replicas > 1 and not self.even_batches:
            batches, self._repeats = _deal(batches, self.num_replicas, self.rank)
        elif self.num_replicas > 1:
            picks = np.arange(len(batches))
            if self.drop_last:
                picks = picks[: len(picks) - len(picks) % self.num_replicas]
            else:  # repeat the first batches (cyclically) until every rank gets the same count
                picks = np.concatenate([picks, np.resize(picks, -len(picks) % self.num_replicas)])
            batches = batches.select(picks[self.rank :: self.num_replicas])
        if not len(batches):
            raise ValueError(
                f"drop_last with {self.num_replicas} replicas leaves no batch "
                f"({len(self.lengths)} examples, max_tokens={self.max_tokens})"
            )
        self._cache = (epoch, batches)
        return batches

    @property
    def repeats_another_rank(self) -> bool:
        """True when this rank's batch is another rank's again (evaluation, `even_batches=False`, of a split
        with fewer batches than ranks): it runs so that the rank's loop, and its collectives, run at all;
        what is computed on it must not be counted a second time (token means, accuracies)."""
        self.batches()
        return self._repeats

    # -- the sampler protocol --------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches()
        start, self._resume_from = self._resume_from, 0
        self._yielded = start
        for batch in batches[start:]:
            self._yielded += 1
            yield batch

    def __len__(self) -> int:
        """Batches of the current epoch on this rank (a resumed epoch still counts them all)."""
        return len(self.batches())

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iterator yields (Lightning calls this every epoch)."""
        if epoch != self.epoch:
            self.epoch, self._resume_from, self._yielded = epoch, 0, 0

    def state_dict(self) -> dict[str, int]:
        """Epoch and batches already yielded in it: enough to continue exactly where it stopped."""
        return {"epoch": self.epoch, "batches_yielded": max(self._yielded, self._resume_from)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """The next iterator skips the batches of `state["epoch"]` that were already yielded."""
        self.epoch = int(state["epoch"])
        self._resume_from = self._yielded = int(state["batches_yielded"])


def _deal(batches: BatchList, num_replicas: int, rank: int) -> tuple[BatchList, bool]:
    """Rank `rank`'s share of `batches` without repeats: every `num_replicas`-th batch. An unshuffled list
    with fewer batches than ranks has each batch cut into ceil(ranks / batches) near-equal parts first (a
    part of a batch fits the budget); with fewer examples than ranks a rank left without a batch gets the
    last one again (and True: its share is a repeat)."""
    if len(batches) < num_replicas and np.array_equal(batches.picks, np.arange(len(batches.bounds) - 1)):
        parts = -(-num_replicas // len(batches))
        starts = [
            start + np.arange(min(parts, end - start)) * (end - start) // min(parts, end - start)
            for start, end in zip(batches.bounds[:-1], batches.bounds[1:])
        ]
        bounds = np.concatenate([*starts, batches.bounds[-1:]]).astype(np.int64)
        batches = BatchList(batches.order, bounds)
    picks = np.arange(rank, len(batches), num_replicas)
    if len(picks):
        return batches.select(picks), False
    return batches.select(np.array([len(batches) - 1])), True


def _compact(lengths: np.ndarray) -> np.ndarray:
    """Lengths as uint16 when they fit (a quarter of the memory; NumPy's stable sort is then a radix sort)."""
    if len(lengths) and lengths.min() >= 0 and lengths.max() < 2**16:
        return lengths.astype(np.uint16)
    return lengths


def truncate(ids: Sequence[int], max_len: int) -> list[int]:
    """Cut to `max_len` tokens keeping the final EOS (an evaluated or translated text longer than the model's
    positions; training drops such examples instead)."""
    return list(ids) if len(ids) <= max_len else [*ids[: max_len - 1], ids[-1]]


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int = PAD_ID) -> Tensor:
    """Right-pad id lists into a (B, L) long tensor, L = the longest.

    One NumPy fill of the row prefixes from the concatenated ids (a tensor per sequence was most of a
    collate's time: 2.0 -> 0.08 ms for 160 sequences of up to 13 ids)."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))  # (B,)
    ids = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    out = np.full((len(seqs), int(lengths.max())), pad_id, dtype=np.int64)  # (B, L)
    out[np.arange(out.shape[1]) < lengths[:, None]] = ids  # row-major: each row's prefix, in order
    return torch.from_numpy(out)


def _source_batch(examples: Sequence[Mapping[str, Any]], pad_id: int) -> dict[str, Tensor]:
    """What every collator returns: src, src_padding_mask and id."""
    src = pad_sequences([ex["src_ids"] for ex in examples], pad_id)  # (B, S)
    return {
        "src": src,
        "src_padding_mask": src == pad_id,  # (B, S) True = padding
        "id": torch.tensor([ex["id"] for ex in examples], dtype=torch.long),  # (B,)
    }


def host_packing(keep: Tensor) -> tuple[Tensor, Tensor, int]:
    """keep (B, L) bool on the host -> the kept positions of the flattened B * L (N,) long, the cumulative
    row lengths (B + 1,) int32 (what variable-length attention kernels take) and the longest row."""
    lengths = keep.sum(dim=1)  # (B,)
    cu_seqlens = torch.zeros(keep.size(0) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    return keep.reshape(-1).nonzero().squeeze(1), cu_seqlens, int(lengths.max()) if keep.numel() else 0


def _prefix(tokens: Tensor, pad_id: int) -> Tensor:
    """(B, T) bool: every position up to each row's last non-pad token, position 0 always (a causal
    decoder's inputs, its start token even when that is the pad id; the model's
    `transformer.packing.prefix_mask`, which data/ may not import)."""
    positions = torch.arange(1, tokens.size(1) + 1)  # (T,)
    return positions <= (tokens.ne(pad_id) * positions).amax(dim=1, keepdim=True).clamp(min=1)  # (B, T)


class TranslationCollator:
    """Examples {"src_ids", "tgt_ids": [BOS .. EOS], "id"} -> src, tgt_in, tgt_out, masks, id.

    Examples without "tgt_ids" (prediction on raw text) give only src, src_padding_mask and id. With
    `packing`, a training batch also holds "packing": for the source's non-pad tokens and the targets'
    prefixes, the kept positions, cumulative lengths and longest row (`host_packing`), which the model's
    packed path takes instead of finding them on the device (`transformer.packing.BatchPacking`).
    """

    def __init__(self, pad_id: int = PAD_ID, packing: bool = False) -> None:
        self.pad_id = pad_id
        self.packing = packing

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = _source_batch(examples, self.pad_id)
        if "tgt_ids" in examples[0]:
            # Teacher forcing: the decoder reads [BOS y1..yn] and predicts [y1..yn EOS].
            tgt_in = pad_sequences([ex["tgt_ids"][:-1] for ex in examples], self.pad_id)  # (B, T)
            tgt_out = pad_sequences([ex["tgt_ids"][1:] for ex in examples], self.pad_id)  # (B, T)
            batch.update(tgt_in=tgt_in, tgt_out=tgt_out, tgt_padding_mask=tgt_in == self.pad_id)
            if self.packing:
                batch["packing"] = self._packing(batch["src_padding_mask"], tgt_in)
        return batch

    def _packing(self, src_padding_mask: Tensor, tgt_in: Tensor) -> dict[str, Tensor | int]:
        return batch_packing(src_padding_mask, tgt_in, self.pad_id)


def batch_packing(src_padding_mask: Tensor, tgt_in: Tensor, pad_id: int) -> dict[str, Tensor | int]:
    """A padded batch's "packing" entry, on the host: `host_packing` of the source's non-pad tokens and
    of the targets' prefixes, as `{src,tgt}_{index,cu_seqlens,max_len}`."""
    packing: dict[str, Tensor | int] = {}
    for side, keep in (("src", ~src_padding_mask), ("tgt", _prefix(tgt_in, pad_id))):
        index, cu_seqlens, max_len = host_packing(keep)
        packing.update({f"{side}_index": index, f"{side}_cu_seqlens": cu_seqlens})
        packing[f"{side}_max_len"] = max_len
    return packing


class ClassificationCollator:
    """Examples {"src_ids", "label", "id"} -> src, src_padding_mask, label, id (label omitted if absent)."""

    def __init__(self, pad_id: int = PAD_ID) -> None:
        self.pad_id = pad_id

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        batch = _source_batch(examples, self.pad_id)
        if "label" in examples[0]:
            batch["label"] = torch.tensor([ex["label"] for ex in examples], dtype=torch.long)  # (B,)
        return batch


class IndexedBatches(torch.utils.data.Dataset):
    """Map-style view: a list of indices gives the list of those examples (for `sampler=` loaders).

    An integer i gives batch i of `batches` (default: the one-example batch [i]). Lightning's
    `overfit_batches` swaps the sampler for a SequentialSampler over this dataset, and then trains on
    the first whole batches of `batches` every epoch.
    """

    def __init__(self, examples: Any, batches: Sequence[list[int]] | None = None) -> None:
        self.examples = examples  # a datasets.Dataset or any indexable of dicts
        self.batches = batches

    def __len__(self) -> int:
        return len(self.examples) if self.batches is None else len(self.batches)

    def __getitem__(self, indices: int | Sequence[int]) -> list[Mapping[str, Any]]:
        if isinstance(indices, int):
            indices = [indices] if self.batches is None else self.batches[indices]
        if not _is_arrow_dataset(self.examples):
            return [self.examples[i] for i in indices]
        columns = self.examples[list(indices)]  # one Arrow read for the whole batch: {column: values}
        return [dict(zip(columns, row)) for row in zip(*columns.values())]


def _is_arrow_dataset(examples: Any) -> bool:
    """Whether `examples` is a `datasets.Dataset`, asked without importing `datasets`: an object of that
    class exists only once the library is loaded, and the batching works without it (a benchmark on a bare
    GPU box that has no `datasets`)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(examples, module.Dataset)
