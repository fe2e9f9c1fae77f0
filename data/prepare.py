"""From a raw split to token ids on disk: tokenizer training text (a seeded sample) and tokenizing into Arrow.

A tokenized split has, per example, "<x>_ids" ([BOS .. EOS], uint16 when the vocabulary fits, else int32),
"<x>_len" and "id" (its row in the raw split), plus the raw split's columns that are not text (e.g. "label").
It is written chunk by chunk into Arrow files (one per worker process), so memory does not grow with the
corpus.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from datasets.arrow_writer import ArrowWriter
from tqdm.auto import tqdm

from data.batching import truncate  # the one cut of an over-long text (here: evaluated splits)

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
    directory: Path,
    workers: int = 1,
    progress: str | None = None,
) -> tuple[datasets.Dataset, int]:
    """Encode `raw` with `encode` into Arrow files in `directory` and memory-map them; returns the dataset
    and the number of over-long examples.

    `encode(batch)` maps a batch of raw rows to {"<x>_ids": [ids per row]} for `id_columns` ("<x>_ids").
    Examples with more than `max_len` tokens on a side are dropped (`drop_long`, for training) or cut to
    `max_len` keeping the final EOS (evaluation scores every example). `workers` > 1 splits the rows
    between that many forked processes (one file each, in row order), where the platform can fork.
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

    def write(span: int, start: int, stop: int, done: Callable[[int], object]) -> int:
        """Rows [start, stop) into the file of `span`; returns how many of them were too long."""
        too_long = 0
        path = directory / f"data-{span:05d}.arrow"
        with ArrowWriter(features=features, path=str(path), writer_batch_size=CHUNK_ROWS) as writer:
            for first in range(start, stop, CHUNK_ROWS):
                batch = raw[first : min(first + CHUNK_ROWS, stop)]
                encoded = encode(batch)
                table, long_ones = _table(batch, encoded, first, kept_columns, features, max_len, drop_long)
                too_long += long_ones
                if table.num_rows:
                    writer.write_table(table)
                done(min(first + CHUNK_ROWS, stop) - first)
            writer.finalize()
        return too_long

    spans = _spans(len(raw), workers if _can_fork() else 1)
    with tqdm(total=len(raw), desc=progress, unit=" examples", disable=progress is None) as bar:
        too_long = write(0, *spans[0], bar.update) if len(spans) == 1 else _in_processes(write, spans, bar)
    parts = [datasets.Dataset.from_file(str(p)) for p in sorted(directory.glob("data-*.arrow"))]
    return (parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)), too_long


def _table(
    batch: Mapping[str, list[Any]],
    encoded: dict[str, list[list[int]]],
    first_row: int,
    kept_columns: Sequence[str],
    features: datasets.Features,
    max_len: int,
    drop_long: bool,
) -> tuple[pa.Table, int]:
    """One chunk's rows as an Arrow table of `features` (over-long ones dropped or cut), and their count."""
    id_columns = list(encoded)
    lengths = {c: np.fromiter(map(len, encoded[c]), np.int64, len(encoded[c])) for c in id_columns}
    too_long = np.logical_or.reduce([lengths[c] > max_len for c in id_columns])  # (rows,)
    rows = np.arange(first_row, first_row + len(too_long))
    columns = {c: batch[c] for c in kept_columns}
    if too_long.any() and drop_long:
        keep = np.flatnonzero(~too_long)
        rows = rows[keep]
        encoded = {c: [encoded[c][i] for i in keep.tolist()] for c in id_columns}
        lengths = {c: lengths[c][keep] for c in id_columns}
        columns = {c: [columns[c][i] for i in keep.tolist()] for c in kept_columns}
    elif too_long.any():
        for c in id_columns:
            for i in np.flatnonzero(lengths[c] > max_len).tolist():
                encoded[c][i] = truncate(encoded[c][i], max_len)
            lengths[c] = np.minimum(lengths[c], max_len)
    arrays: dict[str, pa.Array] = {c: pa.array(columns[c], features[c].pa_type) for c in kept_columns}
    for c in id_columns:
        arrays[c] = _list_array(encoded[c], lengths[c], features[c].feature.dtype)
    arrays["id"] = pa.array(rows, pa.int64())
    for c in id_columns:
        arrays[_len_column(c)] = pa.array(lengths[c].astype(np.int32))
    return pa.table(arrays), int(too_long.sum())


def _can_fork() -> bool:
    """Worker processes are forked (they share the loaded data and tokenizer): Linux only."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _spans(rows: int, workers: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges, one per worker, on chunk boundaries (at least one chunk each)."""
    chunks = max(1, -(-rows // CHUNK_ROWS))
    parts = max(1, min(workers, chunks))
    cuts = [round(chunks * k / parts) * CHUNK_ROWS for k in range(parts + 1)]
    return [(start, min(stop, rows)) for start, stop in itertools.pairwise(cuts)]


def _in_processes(
    write: Callable[[int, int, int, Callable[[int], object]], int], spans: list[tuple[int, int]], bar: tqdm
) -> int:
    """Run `write` on every span in its own forked process; the sum of their counts."""
    context = multiprocessing.get_context("fork")
    done = context.Value("q", 0)  # rows written by all workers, for the progress bar
    results = context.SimpleQueue()

    def advance(rows: int) -> None:
        with done.get_lock():
            done.value += rows

    def work(span: int, start: int, stop: int) -> None:
        try:
            results.put((span, write(span, start, stop, advance), None))
        except BaseException as err:  # reported by the parent, which then fails
            results.put((span, None, f"{type(err).__name__}: {err}"))

    # one tokenizers thread per process; set while forking, so that tokenizers does not warn either
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        workers = [context.Process(target=work, args=(k, *span), daemon=True) for k, span in enumerate(spans)]
        for worker in workers:
            worker.start()
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    while any(worker.is_alive() for worker in workers):
        workers[0].join(0.2)
        bar.update(done.value - bar.n)
    bar.update(done.value - bar.n)
    reports = []
    while not results.empty():
        reports.append(results.get())
    failed = [w.exitcode for w in workers if w.exitcode]
    errors = [error for _, _, error in reports if error]
    if errors or failed or len(reports) != len(spans):
        raise RuntimeError(f"tokenizing in {len(spans)} processes failed: {errors or f'exit codes {failed}'}")
    return sum(count for _, count, _ in reports)


def _len_column(ids_column: str) -> str:
    return ids_column.removesuffix("_ids") + "_len"


def _list_array(seqs: list[list[int]], lengths: np.ndarray, dtype: str) -> pa.ListArray:
    """Rows of ids as one Arrow list array: flat values + offsets (no per-id Arrow conversion)."""
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)  # (rows + 1,)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.dtype(dtype), count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def length_array(dataset: datasets.Dataset, column: str) -> np.ndarray:
    """A length column as one int32 array (read from the memory-mapped file, not as Python ints)."""
    values = dataset.with_format("arrow", columns=[column])[:][column]
    return np.asarray(values.to_numpy() if hasattr(values, "to_numpy") else values, dtype=np.int32)
