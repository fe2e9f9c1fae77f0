"""Translation splits ("src", "tgt"): the built-in synthetic task, Multi30k, directories of line-aligned
`{split}.{lang}` files and hub datasets."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from itertools import zip_longest
from pathlib import Path

import datasets

from data import synthetic, synthetic_numbers
from data.sources.reading import DataError, arrow_dataset, check_dir, find_file, hub_splits, iter_lines

log = logging.getLogger(__name__)

MULTI30K_LAYOUT = "{split}.{lang}.gz"  # the official data/task1/raw names, e.g. train.en.gz
MULTI30K_HUB = "bentrevett/multi30k"  # columns "en", "de"; splits train / validation / test
MULTI30K_HUB_SPLITS = {"val": "validation", "test_2016_flickr": "test"}
_TEXT_PAIRS = datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string")})


def parallel_dataset(sources: Sequence[str], targets: Sequence[str], origin: str) -> datasets.Dataset:
    """Line-aligned texts -> Dataset("src", "tgt"); pairs with an empty side are dropped and counted."""
    if len(sources) != len(targets):
        raise DataError(f"{origin}: source has {len(sources)} lines but target has {len(targets)}")
    pairs = [(src, tgt) for src, tgt in zip(sources, targets) if src and tgt]
    _check_kept(origin, len(sources), len(pairs))
    return datasets.Dataset.from_dict({"src": [p[0] for p in pairs], "tgt": [p[1] for p in pairs]})


def load_parallel(src_path: str | Path, tgt_path: str | Path, src_tag: str | None = None) -> datasets.Dataset:
    """One split from two line-aligned UTF-8 files (plain or .gz), streamed into Arrow.

    Pairs with an empty side are dropped and counted, as in `parallel_dataset`. `src_tag` (e.g. "<bt>")
    is put before every source, separated by a space (tagged back-translation marks synthetic sources).
    """
    origin = f"{src_path} / {tgt_path}"
    lines = 0

    def pairs() -> Iterator[tuple[str, str]]:
        nonlocal lines
        src_lines, tgt_lines = iter_lines(src_path), iter_lines(tgt_path)
        for src, tgt in zip_longest(src_lines, tgt_lines):
            if src is None or tgt is None:  # one file ended first: count the rest of the other
                n_src = lines + (src is not None) + sum(1 for _ in src_lines)
                n_tgt = lines + (tgt is not None) + sum(1 for _ in tgt_lines)
                raise DataError(f"{origin}: source has {n_src} lines but target has {n_tgt}")
            lines += 1
            if src and tgt:
                yield (f"{src_tag} {src}" if src_tag else src), tgt

    dataset = arrow_dataset(pairs(), _TEXT_PAIRS)
    _check_kept(origin, lines, len(dataset))
    return dataset


def _check_kept(origin: str, lines: int, kept: int) -> None:
    """Warn about the `lines - kept` pairs dropped for an empty side; refuse a split with none left."""
    if kept < lines:
        log.warning("%s: dropped %d pairs with an empty line", origin, lines - kept)
    if not kept:
        raise DataError(f"{origin}: split is empty ({lines} lines, none with text on both sides)")


def parallel_files(
    data_dir: str | Path, split: str, src_lang: str, tgt_lang: str, layout: str = MULTI30K_LAYOUT
) -> tuple[Path, Path]:
    """The source and target files of `split` in a directory of `{split}.{lang}` files (plain or .gz)."""
    directory = check_dir(data_dir, layout)
    paths = []
    for lang in (src_lang, tgt_lang):
        path = find_file(directory, layout.format(split=split, lang=lang))
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
    for split, hub_split, table in hub_splits(name, config, splits, split_names):
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


def load_numbers(
    splits: Sequence[str], src_lang: str, tgt_lang: str, seed: int = 0, sizes: Mapping[str, int] | None = None
) -> datasets.DatasetDict:
    """One direction of the built-in multilingual number task (see `data.synthetic_numbers`)."""
    sizes = dict(synthetic_numbers.DEFAULT_SIZES if sizes is None else sizes)
    unknown = [split for split in splits if split not in sizes]
    if unknown:
        raise DataError(f"the numbers task has splits {sorted(sizes)}, not {unknown}")
    try:
        generated = synthetic_numbers.make_pair_splits(src_lang, tgt_lang, seed, sizes)
    except ValueError as err:
        raise DataError(str(err)) from None
    return datasets.DatasetDict(
        {split: parallel_dataset(*generated[split], f"numbers[{split}]") for split in splits}
    )
