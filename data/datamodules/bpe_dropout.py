"""BPE-dropout for the training sources (Provilkov et al., 2020): every epoch a new segmentation of each
source, the same whatever the batches, loader workers or restarts."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from data.batching import truncate
from data.tokenization import BPEDropout, BPETokenizer


class EpochSegmentation:
    """The training sources segmented with BPE-dropout, one epoch at a time (the current one is kept).

    Example `id` of epoch `e` is drawn from a generator seeded with (seed, e, id): the same split whatever
    the batches, workers or restarts. The train sampler packs the epoch by these lengths.
    """

    def __init__(
        self,
        tokenizer: BPETokenizer,
        dropout: float,
        texts: Iterable[str],
        ids: Iterable[int],
        seed: int,
        max_len: int,
    ) -> None:
        self._segmenter = BPEDropout(tokenizer, dropout)
        self._words = [self._segmenter.words(text) for text in texts]  # of every raw training row
        self._ids = list(ids)  # the rows kept for training, in dataset order
        self.seed, self.max_len = seed, max_len
        self._current: tuple[int, dict[int, list[int]]] | None = None

    def sources(self, epoch: int) -> dict[int, list[int]]:
        """Token ids of every training source in `epoch`'s segmentation, by example id, in dataset order."""
        if self._current is not None and self._current[0] == epoch:
            return self._current[1]
        segmented = {
            i: truncate(
                self._segmenter.encode_words(self._words[i], np.random.default_rng([self.seed, epoch, i])),
                self.max_len,
            )
            for i in self._ids
        }
        self._current = (epoch, segmented)
        return segmented
