"""Raw splits as `datasets.DatasetDict`: synthetic task, Multi30k, parallel files, classification files, hub.

Translation splits have columns "src", "tgt"; classification splits "text", "label" (a `ClassLabel`,
-1 = unlabeled). Local files are read into memory (no on-disk cache that could go stale) and bad input
raises `DataError` with one line naming the file, line or value at fault.
"""

from __future__ import annotations

import csv
import gzip
import json
import logging
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import datasets

from data import synthetic

log = logging.getLogger(__name__)

MULTI30K_LAYOUT = "{split}.{lang}.gz"  # the official data/task1/raw names, e.g. train.en.gz
MULTI30K_HUB = "bentrevett/multi30k"  # columns "en", "de"; splits train / validation / test
MULTI30K_HUB_SPLITS = {"val": "validation", "test_2016_flickr": "test"}
SST2_LABELS = ("negative", "positive")
SST2_HUB = "stanfordnlp/sst2"  # columns "sentence", "label" (-1 on the test split); splits like GLUE's
SST2_HUB_SPLITS = {"dev": "validation"}


class DataError(ValueError):
    """Input data that cannot be used as it is: the message names the file, line or value and the fix."""


# -- reading files -------------------------------------------------------------------------------
def read_lines(path: str | Path, strip: bool = True) -> list[str]:
    """Lines of a UTF-8 file (plain or .gz), stripped of surrounding whitespace (or only of the newline)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing file {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    lines = []
    try:
        with opener(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    text = raw.decode("utf-8")
                    lines.append(text.strip() if strip else text.rstrip("\r\n"))
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"{path}:{number}: invalid UTF-8 ({err.reason} at byte {err.start} of the line)"
                    ) from None
    except (OSError, EOFError, zlib.error) as err:  # e.g. a truncated or non-gzip .gz file
        raise DataError(f"cannot read {path}: {err}") from None
    return lines


def _find(directory: Path, name: str) -> Path | None:
    """`name` or `name` + ".gz" (or without ".gz") inside `directory`, whichever exists."""
    stem = name.removesuffix(".gz")
    for candidate in (directory / name, directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _check_dir(data_dir: str | Path, layout: str) -> Path:
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise DataError(f"data directory {directory} does not exist (expected files named {layout})")
    return directory


# -- translation ---------------------------------------------------------------------------------
def parallel_dataset(sources: Sequence[str], targets: Sequence[str], origin: str) -> datasets.Dataset:
    """Line-aligned texts -> Dataset("src", "tgt"); pairs with an empty side are dropped and counted."""
    if len(sources) != len(targets):
        raise DataError(f"{origin}: source has {len(sources)} lines but target has {len(targets)}")
    pairs = [(src, tgt) for src, tgt in zip(sources, targets) if src and tgt]
    if len(pairs) < len(sources):
        log.warning("%s: dropped %d pairs with an empty line", origin, len(sources) - len(pairs))
    if not pairs:
        raise DataError(f"{origin}: split is empty ({len(sources)} lines, none with text on both sides)")
    return datasets.Dataset.from_dict({"src": [p[0] for p in pairs], "tgt": [p[1] for p in pairs]})


def load_parallel(src_path: str | Path, tgt_path: str | Path) -> datasets.Dataset:
    """One split from two line-aligned UTF-8 files (plain or .gz)."""
    return parallel_dataset(read_lines(src_path), read_lines(tgt_path), f"{src_path} / {tgt_path}")


def list_splits(data_dir: str | Path) -> dict[str, list[str]]:
    """{split: [languages]} of the `{split}.{lang}[.gz]` files in `data_dir` (for error messages)."""
    found: dict[str, list[str]] = {}
    for path in sorted(Path(data_dir).iterdir()):
        split, dot, lang = path.name.removesuffix(".gz").rpartition(".")
        if dot and split and path.is_file():
            found.setdefault(split, []).append(lang)
    return found


def load_parallel_dir(
    data_dir: str | Path, splits: Sequence[str], src_lang: str, tgt_lang: str, layout: str = MULTI30K_LAYOUT
) -> datasets.DatasetDict:
    """Splits of a directory of `{split}.{lang}` files (plain or .gz), e.g. Multi30k's data/task1/raw."""
    directory = _check_dir(data_dir, layout)
    result = {}
    for split in splits:
        paths = []
        for lang in (src_lang, tgt_lang):
            path = _find(directory, layout.format(split=split, lang=lang))
            if path is None:
                present = ", ".join(f"{s} ({'/'.join(langs)})" for s, langs in list_splits(directory).items())
                raise DataError(
                    f"missing {directory / layout.format(split=split, lang=lang)}: expected files named "
                    f"{layout} (plain or .gz); splits present: {present or 'none'}"
                )
            paths.append(path)
        result[split] = load_parallel(*paths)
    return datasets.DatasetDict(result)


def load_multi30k(
    data_dir: str | Path | None, splits: Sequence[str], src_lang: str = "en", tgt_lang: str = "de"
) -> datasets.DatasetDict:
    """Multi30k task 1 from `data_dir` (official layout `{split}.{lang}.gz`) or, with None, the hub."""
    if data_dir is not None:
        return load_parallel_dir(data_dir, splits, src_lang, tgt_lang, MULTI30K_LAYOUT)
    return load_translation_hub(MULTI30K_HUB, splits, src_lang, tgt_lang, split_names=MULTI30K_HUB_SPLITS)


def load_translation_hub(
    name: str,
    splits: Sequence[str],
    src_lang: str,
    tgt_lang: str,
    config: str | None = None,
    split_names: Mapping[str, str] | None = None,
) -> datasets.DatasetDict:
    """A hub dataset with one column per language, or a "translation" column of {lang: text} dicts.

    `split_names` maps our split names to the hub's (e.g. "val" -> "validation").
    """
    result = {}
    for split, hub_split, table in _hub_splits(name, config, splits, split_names):
        has_columns = {src_lang, tgt_lang} <= set(table.column_names)
        if "translation" not in table.column_names and not has_columns:
            raise DataError(
                f"hub dataset {name!r} split {hub_split!r} has columns {table.column_names}; expected "
                f"{src_lang!r} and {tgt_lang!r} or a 'translation' column"
            )
        # map/filter keep the hub's on-disk Arrow files (and cache by the hub data's fingerprint):
        # a corpus like WMT14 never has to fit in Python lists.
        pairs = table.map(
            _hub_pairs,
            fn_kwargs={"src_lang": src_lang, "tgt_lang": tgt_lang},
            batched=True,
            remove_columns=table.column_names,
            desc=f"Reading {name}[{hub_split}]",
        )
        kept = pairs.filter(
            lambda batch: [bool(s and t) for s, t in zip(batch["src"], batch["tgt"])], batched=True
        )
        if len(kept) < len(pairs):
            log.warning(
                "%s[%s]: dropped %d pairs with an empty side", name, hub_split, len(pairs) - len(kept)
            )
        if len(kept) == 0:
            raise DataError(
                f"hub dataset {name!r} split {hub_split!r} is empty ({len(pairs)} pairs, none complete)"
            )
        result[split] = kept
    return datasets.DatasetDict(result)


def _hub_splits(
    name: str, config: str | None, splits: Sequence[str], split_names: Mapping[str, str] | None
) -> Iterator[tuple[str, str, datasets.Dataset]]:
    """(our split, the hub's name for it, its table) for each of `splits`, from hub dataset `name`."""
    split_names = split_names or {}
    hub = datasets.load_dataset(name, config)
    for split in splits:
        hub_split = split_names.get(split, split)
        if hub_split not in hub:
            raise DataError(f"hub dataset {name!r} has no split {hub_split!r}; it has {sorted(hub)}")
        yield split, hub_split, hub[hub_split]


def _hub_pairs(batch: Mapping[str, list], src_lang: str, tgt_lang: str) -> dict[str, list[str]]:
    if "translation" in batch:
        missing = {src_lang, tgt_lang} - set(batch["translation"][0]) if batch["translation"] else set()
        if missing:
            raise DataError(
                f"hub translations have languages {sorted(batch['translation'][0])}, not {sorted(missing)}"
            )
        sources = [pair[src_lang] for pair in batch["translation"]]
        targets = [pair[tgt_lang] for pair in batch["translation"]]
    else:
        sources, targets = batch[src_lang], batch[tgt_lang]
    return {"src": [text.strip() for text in sources], "tgt": [text.strip() for text in targets]}


def load_synthetic(
    splits: Sequence[str] = synthetic.SPLITS, seed: int = 0, sizes: Mapping[str, int] | None = None
) -> datasets.DatasetDict:
    """The built-in English -> German number task (see `data.synthetic`); deterministic per seed."""
    sizes = dict(synthetic.DEFAULT_SIZES if sizes is None else sizes)
    unknown = [split for split in splits if split not in sizes]
    if unknown:
        raise DataError(f"the synthetic task has splits {sorted(sizes)}, not {unknown}")
    generated = synthetic.make_synthetic_splits(seed, sizes)
    return datasets.DatasetDict(
        {split: parallel_dataset(*generated[split], f"synthetic[{split}]") for split in splits}
    )


# -- classification ------------------------------------------------------------------------------
def _read_rows(path: Path, text_column: str, label_column: str) -> list[tuple[int, str, str | None]]:
    """(line number, text, raw label or None) of a TSV/CSV/JSONL file with a header / keys."""
    kind = path.name.removesuffix(".gz").rpartition(".")[2].lower()
    lines = read_lines(path, strip=False)  # a TSV line may start with an empty field
    rows: list[tuple[int, str, str | None]] = []
    if kind == "jsonl":
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                rows.append((number, "", None))  # blank line: dropped and counted by the caller
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: invalid JSON ({err.msg})") from None
            if text_column not in record:
                raise DataError(f"{path}:{number}: no key {text_column!r} (keys: {sorted(record)})")
            label = record.get(label_column)
            rows.append((number, str(record[text_column]).strip(), None if label is None else str(label)))
        return rows
    if kind not in ("tsv", "csv"):
        raise DataError(f"{path}: unknown format {kind!r}; expected .tsv, .csv or .jsonl (optionally .gz)")
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
            rows.append((number, "", None))  # blank line: dropped and counted by the caller
            continue
        if len(fields) != len(header):
            raise DataError(f"{path}:{number}: {len(fields)} fields, but the header has {len(header)}")
        rows.append((number, fields[text_at].strip(), None if label_at is None else fields[label_at].strip()))
    return rows


def _label_index(raw: str, names: Sequence[str]) -> int | None:
    if raw in names:
        return names.index(raw)
    if raw.lstrip("-").isdigit() and -1 <= int(raw) < len(names):
        return int(raw)
    return None


def _infer_label_names(raw_labels: Sequence[str | None]) -> list[str]:
    values = sorted({raw for raw in raw_labels if raw is not None and raw != "-1"})
    if all(value.lstrip("-").isdigit() for value in values):
        values.sort(key=int)
    return values


def load_classification_files(
    files: Mapping[str, str | Path],
    text_column: str = "text",
    label_column: str = "label",
    label_names: Sequence[str] | None = None,
    infer_from: str | None = None,
) -> datasets.DatasetDict:
    """{split: file} (TSV/CSV with a header, or JSONL; plain or .gz) -> DatasetDict("text", "label").

    Raw labels are class names or integer indices into `label_names`. Without `label_names` the
    sorted label values of split `infer_from` (default: the first split) become the class names.
    A file without the label column is unlabeled (all -1), as GLUE ships its test splits.
    """
    parsed = {}
    for split, file in files.items():
        path = Path(file)
        rows = _read_rows(path, text_column, label_column)
        kept = [row for row in rows if row[1]]
        if len(kept) < len(rows):
            log.warning("%s: dropped %d empty lines / rows with empty text", path, len(rows) - len(kept))
        if not kept:
            raise DataError(f"{path}: split {split!r} is empty (no row with text)")
        parsed[split] = (path, kept)
    if label_names is None:
        first = infer_from or next(iter(files))
        if first not in parsed:
            raise DataError(f"cannot infer the label set from split {first!r}: it is not loaded")
        label_names = _infer_label_names([row[2] for row in parsed[first][1]])
        if not label_names:
            raise DataError(f"{parsed[first][0]}: no labels to infer the label set from")
    names = [str(name) for name in label_names]
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)}
    )
    result = {}
    for split, (path, rows) in parsed.items():
        labels = []
        for number, _, raw in rows:
            label = -1 if raw is None else _label_index(raw, names)
            if label is None:
                raise DataError(
                    f"{path}:{number}: label {raw!r} is not in the label set {names} (or their indices)"
                )
            labels.append(label)
        if -1 in labels and any(label != -1 for label in labels):
            number = rows[labels.index(-1)][0]
            raise DataError(
                f"{path}:{number}: label -1 (unlabeled) in a labeled split; expected one of {names}"
            )
        texts = [row[1] for row in rows]
        result[split] = datasets.Dataset.from_dict({"text": texts, "label": labels}, features=features)
    return datasets.DatasetDict(result)


def load_sst2(data_dir: str | Path | None, splits: Sequence[str]) -> datasets.DatasetDict:
    """SST-2 from `data_dir` in the GLUE layout (`{split}.tsv[.gz]`: train, dev, test, ...) or the hub."""
    if data_dir is None:
        return load_classification_hub(
            SST2_HUB, splits, text_column="sentence", label_column="label", split_names=SST2_HUB_SPLITS
        )
    directory = _check_dir(data_dir, "{split}.tsv[.gz]")
    files = {}
    for split in splits:
        path = _find(directory, f"{split}.tsv")
        if path is None:
            present = sorted(p.name for p in directory.iterdir() if ".tsv" in p.name)
            raise DataError(
                f"missing {directory / f'{split}.tsv'}: expected the GLUE SST-2 layout "
                f"{{split}}.tsv[.gz] with a 'sentence<TAB>label' header; files present: {present or 'none'}"
            )
        files[split] = path
    return load_classification_files(files, "sentence", "label", label_names=SST2_LABELS)


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
    for split, hub_split, table in _hub_splits(name, config, splits, split_names):
        missing = [c for c in (text_column, label_column) if c not in table.column_names]
        if missing:
            raise DataError(f"hub dataset {name!r} has no columns {missing}; it has {table.column_names}")
        label_feature = table.features[label_column]
        names = getattr(label_feature, "names", None)
        if names is None:
            raise DataError(f"hub dataset {name!r}: column {label_column!r} is not a ClassLabel")
        texts = [text.strip() for text in table[text_column][:]]
        labels = table[label_column][:]
        kept = [(t, label) for t, label in zip(texts, labels) if t]
        if not kept:
            raise DataError(f"hub dataset {name!r} split {hub_split!r} is empty")
        features = datasets.Features(
            {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(names))}
        )
        result[split] = datasets.Dataset.from_dict(
            {"text": [t for t, _ in kept], "label": [label for _, label in kept]}, features=features
        )
    return datasets.DatasetDict(result)


def check_labeled(dataset: datasets.Dataset, split: str) -> None:
    """Refuse to score a split whose labels are all -1 (GLUE's unlabeled test sets)."""
    labels = dataset["label"][:]
    if labels and all(label == -1 for label in labels):
        raise DataError(
            f"split {split!r} is unlabeled (all labels are -1, as GLUE ships its test sets): "
            "it cannot be scored; predict on it instead, or score a labeled split"
        )
