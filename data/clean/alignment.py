"""The `alignment` filter: are the two sides translations of each other? A lexical score learned from the
corpus itself, in a first pass over it (misaligned pairs are few, so true translations co-occur most).

Pass 1 (`fit`) counts, for every pair, the distinct lower-cased words of each side and every (source
word, target word) pair of them, in hashed tables of fixed size (`2**table_bits` buckets: memory does not
grow with the corpus; collisions only add counts). Pass 2 (`keep`) scores a pair: for each word of a side
that is neither rare (in fewer than `min_count` other pairs) nor common (in more than `max_share` of the
pairs: function words, which every caption shares), the best Dice coefficient with a word of the other
side, both counted without this pair (leave-one-out: a pair does not vouch for itself); a side's score is
their mean weighted by inverse document frequency, the pair's the mean of its sides'. Pairs below
`min_score` are rejected; a pair with no scored word, or overlong (over 200 x 200 distinct words), is kept.
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from data.clean.filters import PairFilter

_WORD = re.compile(r"\w+")
_MAX_WORD_PAIRS = 200 * 200  # pairs with more distinct (source, target) words are not counted nor judged
# odd 64-bit constants, one per row of the count-min sketch of word pairs: two rows with independent
# buckets, a pair's count is the smaller of its two (a collision must happen in both to inflate it)
_MIXES = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F))


@dataclass
class AlignmentFilter(PairFilter):
    """Source and target share translated words, by co-occurrence statistics of this corpus."""

    name: ClassVar[str] = "alignment"
    min_score: float = 0.105
    max_share: float = 0.05
    min_count: int = 2
    table_bits: int = 24
    _tables: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._check_number("min_score", 0.0, 1.0, "a number in [0, 1]")
        self._check_number("max_share", 0.0, 1.0, "a number in (0, 1]")
        self._check("max_share", self.max_share > 0, "a number in (0, 1]")
        self._check_int("min_count", 1)
        self._check_int("table_bits", 10)
        self._check("table_bits", self.table_bits <= 30, "an integer in [10, 30]")

    def fit(self, pairs: Iterable[tuple[str, str]], buffered: int = 1 << 20) -> None:
        """Count words and word pairs over the corpus (the first pass), adding them to the tables every
        `buffered` word pairs (16 bytes each: the buffer's bound, whatever the pairs' lengths)."""
        size, words = 1 << self.table_bits, 1 << (self.table_bits - 4)  # far fewer words than word pairs
        src_counts = np.zeros(words, np.int32)
        tgt_counts = np.zeros(words, np.int32)
        joint = np.zeros((len(_MIXES), size), np.int32)
        n = waiting = 0
        buffers: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
        for src, tgt in pairs:
            s, t = _hashes(src), _hashes(tgt)
            n += 1
            buffers[0].append(s)
            buffers[1].append(t)
            if len(s) * len(t) > _MAX_WORD_PAIRS:  # an overlong pair (the length filter's): words only
                continue
            buffers[2].append(self._joint_index(s, t).reshape(len(_MIXES), -1))
            waiting += len(s) * len(t)
            if waiting >= buffered:
                _add(buffers, (src_counts, tgt_counts, joint))
                waiting = 0
        _add(buffers, (src_counts, tgt_counts, joint))
        self._tables = (n, src_counts, tgt_counts, joint)

    def _joint_index(self, s: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Each (source word, target word)'s bucket in each row of the sketch: (rows, S words, T words)."""
        mixed = np.stack([(s[:, None] * mix) ^ t[None, :] for mix in _MIXES])  # (rows, S, T)
        return (mixed * _MIXES[0]) >> np.uint64(64 - self.table_bits)  # the well-mixed high bits

    def keep(self, src: str, tgt: str) -> bool:
        if self._tables is None:
            raise RuntimeError("the alignment filter needs fit() over the corpus before keep()")
        score = self.score(src, tgt)
        return score is None or score >= self.min_score

    def score(self, src: str, tgt: str) -> float | None:
        """The pair's score in [0, 1], None when neither side has a word to score."""
        n, src_counts, tgt_counts, joint = self._tables
        s, t = _hashes(src), _hashes(tgt)
        if not len(s) or not len(t) or len(s) * len(t) > _MAX_WORD_PAIRS:
            return None
        # other pairs with each source word (S,), target word (T,), both (S, T): leave-one-out
        cs = src_counts[_bucket(s, len(src_counts))].astype(np.float64) - 1
        ct = tgt_counts[_bucket(t, len(tgt_counts))].astype(np.float64) - 1  # (T,)
        index = self._joint_index(s, t)  # (rows, S, T)
        both = np.minimum(joint[0][index[0]], joint[1][index[1]])  # the sketch's estimate, (S, T)
        both = both.astype(np.float64) - 1
        dice = 2 * both / np.maximum(cs[:, None] + ct[None, :], 1)  # (S, T)
        scores = [
            self._side(cs, ct, dice, n),  # each source word's best target word
            self._side(ct, cs, dice.T, n),
        ]
        scored = [x for x in scores if x is not None]
        return sum(scored) / len(scored) if scored else None

    def _side(self, own: np.ndarray, other: np.ndarray, dice: np.ndarray, n: int) -> float | None:
        scored = (own >= self.min_count) & (own <= self.max_share * n)  # (own words,)
        if not scored.any():
            return None
        partners = other >= self.min_count  # rare words vouch for nothing
        best = np.where(partners[None, :], dice, 0.0).max(axis=1)  # (own words,)
        idf = np.log(n / (own[scored] + 1))
        return float((idf * best[scored]).sum() / max(idf.sum(), math.ulp(1.0)))


def _add(buffers: tuple[list[np.ndarray], ...], tables: tuple[np.ndarray, ...]) -> None:
    """Add the buffered hashes to the count tables, then empty the buffers."""
    for buffer, table in zip(buffers, tables):
        if buffer:
            if table.ndim == 1:  # words: their hashes' low bits
                _count(table, _bucket(np.concatenate(buffer), len(table)))
            else:  # word pairs: bucket indices per row of the sketch
                index = np.concatenate(buffer, axis=1).astype(np.int64)  # (rows, pairs)
                for row in range(len(table)):
                    _count(table[row], index[row])
            buffer.clear()


def _count(table: np.ndarray, index: np.ndarray) -> None:
    """table[i] += how often i is in `index` (sorting once is faster than `np.add.at` per element)."""
    buckets, counts = np.unique(index, return_counts=True)
    table[buckets] += counts.astype(table.dtype)


def _bucket(hashes: np.ndarray, size: int) -> np.ndarray:
    """Buckets in a table of `size` (a power of two) for word hashes: high bits of a multiplicative mix."""
    return ((hashes * _MIXES[1]) >> np.uint64(64 - size.bit_length() + 1)).astype(np.int64)


def _hashes(text: str) -> np.ndarray:
    """The distinct lower-cased words of `text` as stable 64-bit hashes (the same in every process)."""
    return np.fromiter((_word_hash(w) for w in set(_WORD.findall(text.lower()))), np.uint64)


@functools.lru_cache(maxsize=1 << 16)  # the frequent words' hashes: ~8 MB at most
def _word_hash(word: str) -> int:
    data = word.encode()
    return (zlib.crc32(data) << 32) | zlib.adler32(data)
