"""Classification splits ("text", "label" as a `ClassLabel`, -1 = unlabeled): SST-2, TSV/CSV/JSONL files and
hub datasets, and the check that refuses to score an unlabeled split."""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import datasets
import pyarrow.compute as pc

from data.sources.reading import DataError, arrow_dataset, check_dir, find_file, hub_splits, iter_lines

log = logging.getLogger(__name__)

SST2_LABELS = ("negative", "positive")
SST2_HUB = "stanfordnlp/sst2"  # columns "sentence", "label" (-1 on the test split); splits like GLUE's
SST2_HUB_SPLITS = {"dev": "validation"}


def load_classification_files(
    files: Mapping[str, str | Path],
    text_column: str = "text",
    label_column: str = "label",
    label_names: Sequence[str] | None = None,
    infer_from: str | None = None,
) -> datasets.DatasetDict:
    """{split: file} (TSV/CSV with a header, or JSONL; plain or .gz) -> DatasetDict("text", "label").

    Raw labels are class names or integer indices into `label_names`. Without `label_names` the
    sorted label values of split `infer_from` (default: the first split) become the class names
    (read in a first pass over that file). A file without the label column is unlabeled (all -1), as
    GLUE ships its test splits.
    """
    paths = {split: Path(file) for split, file in files.items()}
    if label_names is None:
        first = infer_from or next(iter(files))
        if first not in paths:
            raise DataError(f"cannot infer the label set from split {first!r}: it is not loaded")
        seen: set[str | None] = set()  # the distinct raw labels of rows with text
        for _, text, raw in _iter_rows(paths[first], text_column, label_column):
            if text:
                seen.add(raw)
        if not seen:
            raise DataError(f"{paths[first]}: split {first!r} is empty (no row with text)")
        label_names = _infer_label_names(seen)
        if not label_names:
            raise DataError(f"{paths[first]}: no labels to infer the label set from")
    names = [str(name) for name in label_names]
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)}
    )
    return datasets.DatasetDict(
        {
            split: _classification_split(path, split, text_column, label_column, names, features)
            for split, path in paths.items()
        }
    )


def _iter_rows(path: Path, text_column: str, label_column: str) -> Iterator[tuple[int, str, str | None]]:
    """(line number, text, raw label or None) of a TSV/CSV/JSONL file with a header / keys."""
    kind = path.name.removesuffix(".gz").rpartition(".")[2].lower()
    if kind not in ("tsv", "csv", "jsonl"):
        raise DataError(f"{path}: unknown format {kind!r}; expected .tsv, .csv or .jsonl (optionally .gz)")
    lines = iter_lines(path, strip=False)  # a TSV line may start with an empty field
    if kind == "jsonl":
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                yield number, "", None  # blank line: dropped and counted by the caller
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: invalid JSON ({err.msg})") from None
            if text_column not in record:
                raise DataError(f"{path}:{number}: no key {text_column!r} (keys: {sorted(record)})")
            label = record.get(label_column)
            yield number, str(record[text_column]).strip(), None if label is None else str(label)
        return
    # GLUE's TSVs are not quoted (sentences contain '"'), so TSV is read without quote handling.
    reader = csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE) if kind == "tsv" else csv.reader(lines)
    header = next(reader, None)
    if not header:
        raise DataError(f"{path}: split is empty (no header line)")
    if text_column not in header:
        raise DataError(f"{path}:1: no column {text_column!r} in the header {header}")
    text_at = header.index(text_column)
    label_at = header.index(label_column) if label_column in header else None
    for fields in reader:
        number = reader.line_num
        if not any(field.strip() for field in fields):
            yield number, "", None  # blank line: dropped and counted by the caller
            continue
        if len(fields) != len(header):
            raise DataError(f"{path}:{number}: {len(fields)} fields, but the header has {len(header)}")
        yield number, fields[text_at].strip(), None if label_at is None else fields[label_at].strip()


def _label_index(raw: str, names: Sequence[str]) -> int | None:
    if raw in names:
        return names.index(raw)
    if raw.lstrip("-").isdigit() and -1 <= int(raw) < len(names):
        return int(raw)
    return None


def _infer_label_names(raw_labels: Iterable[str | None]) -> list[str]:
    values = sorted({raw for raw in raw_labels if raw is not None and raw != "-1"})
    if all(value.lstrip("-").isdigit() for value in values):
        values.sort(key=int)
    return values


def _classification_split(
    path: Path,
    split: str,
    text_column: str,
    label_column: str,
    names: Sequence[str],
    features: datasets.Features,
) -> datasets.Dataset:
    """One classification file streamed into Arrow; rows with empty text are dropped and counted."""
    rows = labeled = 0
    unlabeled_at: int | None = None  # line of the first unlabeled row

    def examples() -> Iterator[tuple[str, int]]:
        nonlocal rows, labeled, unlabeled_at
        for number, text, raw in _iter_rows(path, text_column, label_column):
            rows += 1
            if not text:
                continue
            label = -1 if raw is None else _label_index(raw, names)
            if label is None:
                raise DataError(
                    f"{path}:{number}: label {raw!r} is not in the label set {list(names)} (or their indices)"
                )
            if label == -1 and unlabeled_at is None:
                unlabeled_at = number
            labeled += label != -1
            yield text, label

    dataset = arrow_dataset(examples(), features)
    kept = len(dataset)
    if kept < rows:
        log.warning("%s: dropped %d empty lines / rows with empty text", path, rows - kept)
    if not kept:
        raise DataError(f"{path}: split {split!r} is empty (no row with text)")
    if unlabeled_at is not None and labeled:
        expected = list(names)
        raise DataError(
            f"{path}:{unlabeled_at}: label -1 (unlabeled) in a labeled split; expected one of {expected}"
        )
    return dataset


def classification_file(data_dir: str | Path, file_pattern: str, split: str) -> Path:
    """The file of `split` in a directory of files named `file_pattern` (e.g. "{split}.tsv"), plain or .gz."""
    directory = check_dir(data_dir, file_pattern)
    name = file_pattern.format(split=split)
    path = find_file(directory, name)
    if path is None:
        present = sorted(p.name for p in directory.iterdir())
        raise DataError(
            f"missing {directory / name}: expected files named {file_pattern} (plain or .gz); "
            f"files present: {present or 'none'}"
        )
    return path


def load_sst2(data_dir: str | Path | None, splits: Sequence[str]) -> datasets.DatasetDict:
    """SST-2 from `data_dir` in the GLUE layout (`{split}.tsv[.gz]`: train, dev, test, ...) or the hub."""
    if data_dir is None:
        return load_classification_hub(
            SST2_HUB, splits, text_column="sentence", label_column="label", split_names=SST2_HUB_SPLITS
        )
    files = {split: sst2_file(data_dir, split) for split in splits}
    return load_classification_files(files, "sentence", "label", label_names=SST2_LABELS)


def sst2_file(data_dir: str | Path, split: str) -> Path:
    """The file of `split` in a GLUE SST-2 directory (`{split}.tsv[.gz]`)."""
    directory = check_dir(data_dir, "{split}.tsv[.gz]")
    path = find_file(directory, f"{split}.tsv")
    if path is None:
        present = sorted(p.name for p in directory.iterdir() if ".tsv" in p.name)
        raise DataError(
            f"missing {directory / f'{split}.tsv'}: expected the GLUE SST-2 layout "
            f"{{split}}.tsv[.gz] with a 'sentence<TAB>label' header; files present: {present or 'none'}"
        )
    return path


def load_classification_hub(
    name: str,
    splits: Sequence[str],
    text_column: str,
    label_column: str,
    config: str | None = None,
    split_names: Mapping[str, str] | None = None,
) -> datasets.DatasetDict:
    """A hub classification dataset whose label column is a ClassLabel (-1 = unlabeled)."""
    result = {}
    for split, hub_split, table in hub_splits(name, config, splits, split_names):
        missing = [c for c in (text_column, label_column) if c not in table.column_names]
        if missing:
            raise DataError(f"hub dataset {name!r} has no columns {missing}; it has {table.column_names}")
        label_feature = table.features[label_column]
        names = getattr(label_feature, "names", None)
        if names is None:
            raise DataError(f"hub dataset {name!r}: column {label_column!r} is not a ClassLabel")
        features = datasets.Features(
            {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(names))}
        )
        # map/filter stay on the hub's Arrow files (as for translation): no whole-split Python lists
        texts = table.map(
            lambda batch: {"text": [t.strip() for t in batch[text_column]], "label": batch[label_column]},
            batched=True,
            remove_columns=table.column_names,
            features=features,
            desc=f"Reading {name}[{hub_split}]",
        )
        kept = texts.filter(lambda batch: [bool(t) for t in batch["text"]], batched=True)
        if len(kept) == 0:
            raise DataError(f"hub dataset {name!r} split {hub_split!r} is empty")
        result[split] = kept
    return datasets.DatasetDict(result)


def check_labeled(dataset: datasets.Dataset, split: str) -> None:
    """Refuse to score a split whose labels are all -1 (GLUE's unlabeled test sets)."""
    labels = dataset.with_format("arrow", columns=["label"])[:]["label"]
    if len(labels) and pc.max(labels).as_py() == -1:
        raise DataError(
            f"split {split!r} is unlabeled (all labels are -1, as GLUE ships its test sets): "
            "it cannot be scored; predict on it instead, or score a labeled split"
        )
