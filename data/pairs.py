"""Several translation pairs in one experiment (`data.pairs`, docs/multilingual.md): which pairs, where each
comes from, and how training batches are drawn over them (temperature sampling, as fairseq's multilingual
task: pair i is drawn with probability proportional to n_i^(1/T))."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from data.batching import BatchList, TokenBudgetBatchSampler

log = logging.getLogger(__name__)

PAIR_SOURCES = ("numbers", "multi30k", "parallel", "hub")  # what a pair may be read from
_PAIR_KEYS = ("src", "tgt", "source", "data_dir", "hub_name", "hub_config")


@dataclass(frozen=True)
class Pair:
    """One translation direction and where its splits come from (None: the datamodule's own setting)."""

    src: str
    tgt: str
    source: str | None = None
    data_dir: str | None = None
    hub_name: str | None = None
    hub_config: str | None = None

    @property
    def name(self) -> str:
        """The direction's name everywhere (metric keys, file names, report rows): "en-de"."""
        return f"{self.src}-{self.tgt}"

    def key(self) -> dict[str, Any]:
        """What identifies the pair in cache keys (the languages and its own source settings)."""
        return {k: getattr(self, k) for k in _PAIR_KEYS if getattr(self, k) is not None}


def parse_pairs(value: Any, where: str = "data.pairs") -> list[Pair]:
    """`data.pairs`: a non-empty list of "en-de" strings or {src, tgt, source, data_dir, hub_name,
    hub_config} mappings; raises ValueError naming the entry at fault."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(
            f"{where} must be null or a non-empty list of pairs like [en-de, en-fr], got {value!r}"
        )
    pairs = [_parse_pair(entry, f"{where}[{i}]") for i, entry in enumerate(value)]
    names = [pair.name for pair in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{where} lists {', '.join(repeated)} more than once")
    return pairs


def _parse_pair(entry: Any, where: str) -> Pair:
    if isinstance(entry, str):
        src, dash, tgt = entry.partition("-")
        if not dash or not src or not tgt or "-" in tgt:
            raise ValueError(
                f"{where} must be SRC-TGT (e.g. en-de) or a mapping {{src: .., tgt: ..}}, got {entry!r}"
            )
        fields: dict[str, Any] = {"src": src, "tgt": tgt}
    elif isinstance(entry, Mapping):
        unknown = sorted(set(map(str, entry)) - set(_PAIR_KEYS))
        if unknown or not entry.get("src") or not entry.get("tgt"):
            raise ValueError(
                f"{where} must be {{src: LANG, tgt: LANG[, source, data_dir, hub_name, hub_config]}}, got "
                f"{dict(entry)}" + (f" (unknown keys: {unknown})" if unknown else "")
            )
        fields = {k: (None if entry.get(k) is None else str(entry[k])) for k in _PAIR_KEYS}
    else:
        raise ValueError(f"{where} must be SRC-TGT (e.g. en-de) or a mapping, got {entry!r}")
    pair = Pair(**fields)
    if pair.src == pair.tgt:
        raise ValueError(f"{where}: source and target language are both {pair.src!r}")
    if pair.source is not None and pair.source not in PAIR_SOURCES:
        raise ValueError(f"{where}.source must be one of {', '.join(PAIR_SOURCES)}, got {pair.source!r}")
    return pair


def check_temperature(value: Any, where: str = "data.sampling_temperature") -> float:
    """A temperature > 0 (inf allowed: uniform over pairs); ValueError otherwise."""
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ValueError(
            f"{where} must be a number > 0 (1: proportional to the pairs' sizes, inf: uniform), got {value!r}"
        )
    return float(value)


def temperature_probabilities(counts: Sequence[int], temperature: float) -> np.ndarray:
    """p_i proportional to n_i^(1/T) over the pairs' example counts (T=1: proportional, T=inf: uniform over
    the pairs that have examples); a pair with none gets 0."""
    n = np.asarray(counts, dtype=np.float64)  # (P,)
    if n.ndim != 1 or not len(n) or (n < 0).any() or not (n > 0).any():
        raise ValueError(f"pair sizes must be counts with at least one above 0, got {list(counts)}")
    weights = np.where(n > 0, np.power(n, 0.0 if math.isinf(temperature) else 1.0 / temperature), 0.0)
    return weights / weights.sum()


class PairSampledBatchSampler(TokenBudgetBatchSampler):
    """Training batches over several pairs: each batch holds examples of one pair (fairseq's way), packed
    in the token budget exactly as `TokenBudgetBatchSampler` packs one corpus; an epoch has as many batches
    as the pairs' batch lists together, and each is drawn from pair i with probability `probabilities[i]`
    (`temperature_probabilities`): a pair's batches are taken in a shuffled order, repeated when it is
    drawn more often than it has batches. Deterministic per (seed, epoch), so DDP ranks and a resumed run
    see the same list; everything else (ranks, resume, `epoch_lengths`) is the base's.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        pair_of: Sequence[int],
        probabilities: Sequence[float],
        max_tokens: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(lengths, max_tokens, **kwargs)
        self.pair_of = np.asarray(pair_of, dtype=np.int64)  # (N,) the pair of each example
        self.probabilities = np.asarray(probabilities, dtype=np.float64)  # (P,)
        if self.pair_of.shape != self.lengths.shape:
            raise ValueError(
                f"pair_of must give one pair per example ({len(self.lengths)}), got {len(self.pair_of)}"
            )
        if len(self.pair_of) and not 0 <= self.pair_of.min() <= self.pair_of.max() < len(self.probabilities):
            raise ValueError(f"pair_of holds pairs outside 0..{len(self.probabilities) - 1}")
        present = np.bincount(self.pair_of, minlength=len(self.probabilities)) > 0
        self.probabilities = np.where(present, self.probabilities, 0.0)
        self.probabilities /= self.probabilities.sum()

    def _all_batches(self, epoch: int) -> BatchList:
        lengths = self._lengths_of(epoch)
        rng = np.random.default_rng([self.seed, epoch])
        packed = [
            self._pair_batches(np.flatnonzero(self.pair_of == p), lengths, rng)
            for p in range(len(self.probabilities))
        ]
        counts = [len(batches) for batches in packed]
        offsets = np.cumsum([0, *counts])  # first global batch of each pair
        order = np.concatenate([b.order for b in packed])
        starts = np.concatenate(
            [b.bounds[:-1] + sum(len(x.order) for x in packed[:p]) for p, b in enumerate(packed)]
            + [[len(order)]]
        ).astype(np.int64)
        drawn = rng.choice(len(counts), size=sum(counts), p=self.probabilities)  # the pair of each batch
        picks = np.empty(len(drawn), dtype=np.int64)
        for p, count in enumerate(counts):
            slots = np.flatnonzero(drawn == p)
            if not len(slots):
                continue
            rounds = -(-len(slots) // count)  # whole passes over the pair's batches, each in a new order
            sequence = np.concatenate([rng.permutation(count) for _ in range(rounds)])[: len(slots)]
            picks[slots] = offsets[p] + sequence
        return BatchList(order, starts, picks)

    def _pair_batches(self, examples: np.ndarray, lengths: np.ndarray, rng: np.random.Generator) -> BatchList:
        """One pair's batches as the base packs a shuffled corpus: permuted, sorted by length in pools."""
        if not len(examples):
            return BatchList(examples, np.zeros(1, dtype=np.int64))
        order = rng.permutation(examples)
        pool = self.pool_size or len(order)
        pools = [order[i : i + pool] for i in range(0, len(order), pool)]
        order = np.concatenate([p[np.argsort(lengths[p], kind="stable")] for p in pools])
        return self._pack(order, lengths)


def pair_counts(pair_of: Sequence[int], n_pairs: int) -> list[int]:
    """How many examples each pair has (`pair_of`: the pair of each example)."""
    return np.bincount(np.asarray(pair_of, dtype=np.int64), minlength=n_pairs).tolist()
