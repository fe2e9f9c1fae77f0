"""Raw splits as `datasets.DatasetDict`: synthetic task, Multi30k, parallel files, classification files, hub.

Translation splits have columns "src", "tgt"; classification splits "text", "label" (a `ClassLabel`,
-1 = unlabeled). Local files are streamed into temporary Arrow files (memory-mapped, never whole-corpus
Python lists, removed at exit) and bad input raises `DataError` with one line naming the file, line or
value at fault.
"""

from __future__ import annotations

import csv
import gzip
import json
import logging
import uuid
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import zip_longest
from pathlib import Path

import datasets
import pyarrow.compute as pc
from datasets.arrow_writer import ArrowWriter

from data import synthetic

log = logging.getLogger(__name__)

MULTI30K_LAYOUT = "{split}.{lang}.gz"  # the official data/task1/raw names, e.g. train.en.gz
MULTI30K_HUB = "bentrevett/multi30k"  # columns "en", "de"; splits train / validation / test
MULTI30K_HUB_SPLITS = {"val": "validation", "test_2016_flickr": "test"}
SST2_LABELS = ("negative", "positive")
SST2_HUB = "stanfordnlp/sst2"  # columns "sentence", "label" (-1 on the test split); splits like GLUE's
SST2_HUB_SPLITS = {"dev": "validation"}
_CHUNK_ROWS = 50_000  # rows read and written at a time when streaming a file into Arrow
_TEXT_PAIRS = datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string")})


class DataError(ValueError):
    """Input data that cannot be used as it is: the message names the file, line or value and the fix."""


# -- reading files -------------------------------------------------------------------------------
def iter_lines(path: str | Path, strip: bool = True) -> Iterator[str]:
    """Lines of a UTF-8 file (plain or .gz), stripped of surrounding whitespace (or only of the newline)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing file {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"{path}:{number}: invalid UTF-8 ({err.reason} at byte {err.start} of the line)"
                    ) from None
                yield text.strip() if strip else text.rstrip("\r\n")
    except (OSError, EOFError, zlib.error) as err:  # e.g. a truncated or non-gzip .gz file
        raise DataError(f"cannot read {path}: {err}") from None


def read_lines(path: str | Path, strip: bool = True) -> list[str]:
    """All of `iter_lines` as a list (small files; corpora are streamed)."""
    return list(iter_lines(path, strip))


def arrow_dataset(chunks: Iterable[Mapping[str, list]], features: datasets.Features) -> datasets.Dataset:
    """Write `chunks` (columns of a few thousand rows each) into an Arrow file and memory-map it.

    The file lives in `datasets`' temporary directory, removed when the process ends: a corpus is
    streamed from its text files to disk without ever being a Python list.
    """
    directory = Path(datasets.fingerprint.get_temporary_cache_files_directory())
    path = directory / f"raw-{uuid.uuid4().hex}.arrow"
    with ArrowWriter(features=features, path=str(path), writer_batch_size=_CHUNK_ROWS) as writer:
        for chunk in chunks:
            writer.write_batch(dict(chunk))
        writer.finalize()
    return datasets.Dataset.from_file(str(path))


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
    """One split from two line-aligned UTF-8 files (plain or .gz), streamed into Arrow.

    Pairs with an empty side are dropped and counted, as in `parallel_dataset`.
    """
    origin = f"{src_path} / {tgt_path}"
    counts = {"lines": 0, "kept": 0}

    def chunks() -> Iterator[dict[str, list[str]]]:
        chunk: dict[str, list[str]] = {"src": [], "tgt": []}
        src_lines, tgt_lines = iter_lines(src_path), iter_lines(tgt_path)
        for src, tgt in zip_longest(src_lines, tgt_lines):
            if src is None or tgt is None:  # one file ended first: count the rest of the other
                n_src = counts["lines"] + (src is not None) + sum(1 for _ in src_lines)
                n_tgt = counts["lines"] + (tgt is not None) + sum(1 for _ in tgt_lines)
                raise DataError(f"{origin}: source has {n_src} lines but target has {n_tgt}")
            counts["lines"] += 1
            if src and tgt:
                chunk["src"].append(src)
                chunk["tgt"].append(tgt)
            if len(chunk["src"]) == _CHUNK_ROWS:
                counts["kept"] += _CHUNK_ROWS
                yield chunk
                chunk = {"src": [], "tgt": []}
        counts["kept"] += len(chunk["src"])
        if chunk["src"]:
            yield chunk

    dataset = arrow_dataset(chunks(), _TEXT_PAIRS)
    lines, kept = counts["lines"], counts["kept"]
    if kept < lines:
        log.warning("%s: dropped %d pairs with an empty line", origin, lines - kept)
    if not kept:
        raise DataError(f"{origin}: split is empty ({lines} lines, none with text on both sides)")
    return dataset


def parallel_files(
    data_dir: str | Path, split: str, src_lang: str, tgt_lang: str, layout: str = MULTI30K_LAYOUT
) -> tuple[Path, Path]:
    """The source and target files of `split` in a directory of `{split}.{lang}` files (plain or .gz)."""
    directory = _check_dir(data_dir, layout)
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
    return paths[0], paths[1]


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
    files = {split: parallel_files(data_dir, split, src_lang, tgt_lang, layout) for split in splits}
    return datasets.DatasetDict({split: load_parallel(*pair) for split, pair in files.items()})


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


def _classification_split(
    path: Path,
    split: str,
    text_column: str,
    label_column: str,
    names: Sequence[str],
    features: datasets.Features,
) -> datasets.Dataset:
    """One classification file streamed into Arrow; rows with empty text are dropped and counted."""
    counts = {"rows": 0, "kept": 0, "labeled": 0}
    unlabeled_at: list[int] = []  # line of the first unlabeled row

    def chunks() -> Iterator[dict[str, list]]:
        chunk: dict[str, list] = {"text": [], "label": []}
        for number, text, raw in _iter_rows(path, text_column, label_column):
            counts["rows"] += 1
            if not text:
                continue
            label = -1 if raw is None else _label_index(raw, names)
            if label is None:
                raise DataError(
                    f"{path}:{number}: label {raw!r} is not in the label set {list(names)} (or their indices)"
                )
            if label == -1 and not unlabeled_at:
                unlabeled_at.append(number)
            counts["labeled"] += label != -1
            chunk["text"].append(text)
            chunk["label"].append(label)
            if len(chunk["text"]) == _CHUNK_ROWS:
                counts["kept"] += _CHUNK_ROWS
                yield chunk
                chunk = {"text": [], "label": []}
        counts["kept"] += len(chunk["text"])
        if chunk["text"]:
            yield chunk

    dataset = arrow_dataset(chunks(), features)
    rows, kept = counts["rows"], counts["kept"]
    if kept < rows:
        log.warning("%s: dropped %d empty lines / rows with empty text", path, rows - kept)
    if not kept:
        raise DataError(f"{path}: split {split!r} is empty (no row with text)")
    if unlabeled_at and counts["labeled"]:
        expected = list(names)
        raise DataError(
            f"{path}:{unlabeled_at[0]}: label -1 (unlabeled) in a labeled split; expected one of {expected}"
        )
    return dataset


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
    directory = _check_dir(data_dir, "{split}.tsv[.gz]")
    path = _find(directory, f"{split}.tsv")
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
    for split, hub_split, table in _hub_splits(name, config, splits, split_names):
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
