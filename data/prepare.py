"""From a raw split to token ids on disk: tokenizer training text (a seeded sample) and tokenizing into Arrow.

A tokenized split has, per example, "<x>_ids" ([BOS .. EOS], uint16 when the vocabulary fits, else int32),
"<x>_len" and "id" (its row in the raw split), plus the raw split's columns that are not text (e.g. "label").
It is written chunk by chunk into one Arrow file, so memory does not grow with the corpus.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from datasets.arrow_writer import ArrowWriter
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

CHUNK_ROWS = 10_000  # examples encoded and written at a time (and rows per Arrow record batch)
SAMPLE_SEED = 0  # one fixed seed: runs with different `seed`s share a tokenizer and its cache entries

Encoder = Callable[[Mapping[str, list[Any]]], dict[str, list[list[int]]]]


def tokenizer_texts(
    dataset: datasets.Dataset, columns: Sequence[str], sample_size: int | None
) -> tuple[Iterator[list[str]], int]:
    """Batches of texts to train a tokenizer on, and how many texts they hold.

    The texts of `columns` column after column (e.g. every source, then every target), of every row, or of a
    seeded sample of `sample_size` rows (kept in split order) when the split has more rows.
    """
    rows = len(dataset)
    chosen = None
    if sample_size is not None and rows > sample_size:
        chosen = np.sort(np.random.default_rng(SAMPLE_SEED).choice(rows, size=sample_size, replace=False))
    count = (rows if chosen is None else len(chosen)) * len(columns)

    def batches() -> Iterator[list[str]]:
        for column in columns:
            table = dataset.select_columns([column])
            if chosen is None:
                for start in range(0, rows, CHUNK_ROWS):
                    yield table[start : start + CHUNK_ROWS][column]
            else:
                for start in range(0, len(chosen), CHUNK_ROWS):
                    yield table[chosen[start : start + CHUNK_ROWS]][column]

    return batches(), count


def ids_dtype(vocab_size: int) -> str:
    """The narrowest Arrow integer type that holds every id (halves the cache for vocabularies <= 65536)."""
    return "uint16" if vocab_size <= 2**16 else "int32"


def tokenize_split(
    raw: datasets.Dataset,
    encode: Encoder,
    text_columns: Sequence[str],
    id_columns: Sequence[str],
    *,
    max_len: int,
    drop_long: bool,
    dtype: str,
    path: Path,
    progress: str | None = None,
) -> tuple[datasets.Dataset, int]:
    """Encode `raw` with `encode` into the Arrow file `path` and memory-map it; returns it and a count.

    `encode(batch)` maps a batch of raw rows to {"<x>_ids": [ids per row]} for `id_columns` ("<x>_ids").
    Examples with more than `max_len` tokens on a side are dropped (`drop_long`, for training) or cut to
    `max_len` keeping the final EOS (evaluation scores every example); the count is of those examples.
    `progress`: the title of a progress bar, None for none.
    """
    kept_columns = [c for c in raw.column_names if c not in text_columns]
    features = datasets.Features(
        {
            **{c: raw.features[c] for c in kept_columns},
            **{c: datasets.List(datasets.Value(dtype)) for c in id_columns},
            "id": datasets.Value("int64"),
            **{_len_column(c): datasets.Value("int32") for c in id_columns},
        }
    )
    too_long_total = 0
    bar = tqdm(total=len(raw), desc=progress, unit=" examples", disable=progress is None)
    with bar, ArrowWriter(features=features, path=str(path), writer_batch_size=CHUNK_ROWS) as writer:
        for start in range(0, len(raw), CHUNK_ROWS):
            batch = raw[start : start + CHUNK_ROWS]
            encoded = encode(batch)
            lengths = {c: np.fromiter(map(len, encoded[c]), np.int64, len(encoded[c])) for c in id_columns}
            too_long = np.logical_or.reduce([lengths[c] > max_len for c in id_columns])
            too_long_total += int(too_long.sum())
            bar.update(len(too_long))
            rows = np.arange(start, start + len(too_long))
            if too_long.any() and drop_long:
                keep = np.flatnonzero(~too_long)
                rows = rows[keep]
                for c in id_columns:
                    encoded[c] = [encoded[c][i] for i in keep.tolist()]
                    lengths[c] = lengths[c][keep]
                batch = {c: [batch[c][i] for i in keep.tolist()] for c in kept_columns}
            elif too_long.any():
                for c in id_columns:
                    for i in np.flatnonzero(lengths[c] > max_len).tolist():
                        encoded[c][i] = truncate(encoded[c][i], max_len)
                    lengths[c] = np.minimum(lengths[c], max_len)
            if len(rows) == 0:
                continue
            columns: dict[str, pa.Array] = {c: pa.array(batch[c], features[c].pa_type) for c in kept_columns}
            for c in id_columns:
                columns[c] = _list_array(encoded[c], lengths[c], dtype)
            columns["id"] = pa.array(rows, pa.int64())
            for c in id_columns:
                columns[_len_column(c)] = pa.array(lengths[c].astype(np.int32))
            writer.write_table(pa.table(columns))
        writer.finalize()
    return datasets.Dataset.from_file(str(path)), too_long_total


def _len_column(ids_column: str) -> str:
    return ids_column.removesuffix("_ids") + "_len"


def _list_array(seqs: list[list[int]], lengths: np.ndarray, dtype: str) -> pa.ListArray:
    """Rows of ids as one Arrow list array: flat values + offsets (no per-id Arrow conversion)."""
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)  # (rows + 1,)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.dtype(dtype), count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def truncate(ids: Sequence[int], max_len: int) -> list[int]:
    """Cut to `max_len` tokens keeping the final EOS."""
    return list(ids) if len(ids) <= max_len else [*ids[: max_len - 1], ids[-1]]


def length_array(dataset: datasets.Dataset, column: str) -> np.ndarray:
    """A length column as one int32 array (read from the memory-mapped file, not as Python ints)."""
    values = dataset.with_format("arrow", columns=[column])[:][column]
    return np.asarray(values.to_numpy() if hasattr(values, "to_numpy") else values, dtype=np.int32)
