"""A raw training split cleaned into Arrow: what the datamodule caches as prepared data.

The split is read `CHUNK_ROWS` rows at a time and the kept pairs written as they come, so memory does
not grow with the corpus; the report is written beside the Arrow file as `clean_report.json`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import datasets
from datasets.arrow_writer import ArrowWriter

from data.clean.run import REPORT_FILE, Report, fit, judge, new_report
from data.clean.settings import CleanSettings

CHUNK_ROWS = 10_000


def clean_split(
    raw: datasets.Dataset, settings: CleanSettings, directory: Path, origin: str
) -> tuple[datasets.Dataset, Report]:
    """The pairs of `raw` ("src", "tgt") that pass the filters, in `directory`/data-00000.arrow, memory-
    mapped, and the report (also written to `directory`/clean_report.json). DataError if none is kept."""
    filters = settings.filters()
    report = new_report(origin, filters, (settings.src_lang, settings.tgt_lang))
    fit(filters, lambda: _pairs(raw))
    path = directory / "data-00000.arrow"
    features = datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string")})
    kept = ((src, tgt) for src, tgt, rejected in judge(_pairs(raw), filters, report) if not rejected)
    with ArrowWriter(features=features, path=str(path), writer_batch_size=CHUNK_ROWS) as writer:
        while chunk := list(itertools.islice(kept, CHUNK_ROWS)):
            writer.write_batch({"src": [p[0] for p in chunk], "tgt": [p[1] for p in chunk]})
        writer.finalize()
    report.check_kept()
    report.write(directory / REPORT_FILE)
    return datasets.Dataset.from_file(str(path)), report


def _pairs(raw: datasets.Dataset) -> Iterator[tuple[str, str]]:
    table = raw.select_columns(["src", "tgt"])
    for start in range(0, len(table), CHUNK_ROWS):
        batch = table[start : start + CHUNK_ROWS]
        yield from zip(batch["src"], batch["tgt"])
