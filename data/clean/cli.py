"""`python -m data.clean SRC TGT --output-dir DIR` (or `aiayn-clean`): the `data.clean` filters on two
line-aligned files, for cleaning before any training.

Writes into DIR: the kept pairs under the inputs' names (without .gz: DIR is then a `source=parallel`
data_dir), `rejected.tsv` (line, the filters that reject it, source, target) and `clean_report.json`.
Files are written under temporary names and renamed at the end; existing outputs are never overwritten.
Every failure is one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path
from typing import Any

import yaml

from data.clean.run import REPORT_FILE, Report, fit, judge, new_report
from data.clean.settings import FILTERS, CleanSettings
from data.sources import DataError, iter_lines

REJECTED_FILE = "rejected.tsv"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.clean", description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="source file, one sentence a line (plain or .gz)")
    parser.add_argument("tgt", type=Path, help="target file, line-aligned with the source")
    parser.add_argument("--output-dir", type=Path, required=True, help="where the outputs go (created)")
    parser.add_argument(
        "--config",
        type=Path,
        help="YAML mapping of filter -> settings, as data.clean (e.g. configs/data/clean/default.yaml); "
        f"default: every filter ({', '.join(FILTERS)}) with its defaults",
    )
    parser.add_argument("--src-lang", help="the source's language (default: the file's suffix, e.g. en)")
    parser.add_argument("--tgt-lang", help="the target's language (default: the file's suffix)")
    args = parser.parse_args(argv)
    try:
        report = clean_files(
            args.src, args.tgt, args.output_dir, _config(args.config), args.src_lang, args.tgt_lang
        )
    except (DataError, ValueError, OSError) as err:
        message = " ".join(str(err).split())
        if isinstance(err, OSError) and err.filename:
            message = f"{err.filename}: {err.strerror or err}"
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    print(report.summary())
    print(f"outputs in {args.output_dir}: kept pairs, {REJECTED_FILE}, {REPORT_FILE}")


def clean_files(
    src: Path,
    tgt: Path,
    output_dir: Path,
    config: dict[str, Any] | None = None,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
) -> Report:
    """Clean the pairs of `src` / `tgt` into `output_dir` (see the module's docstring); the report."""
    src_lang, tgt_lang = src_lang or _suffix_lang(src), tgt_lang or _suffix_lang(tgt)
    settings = CleanSettings({name: {} for name in FILTERS} if config is None else config, src_lang, tgt_lang)
    outputs = [output_dir / _plain_name(src), output_dir / _plain_name(tgt)]
    outputs += [output_dir / REJECTED_FILE, output_dir / REPORT_FILE]
    if outputs[0] == outputs[1]:
        raise DataError(f"{src} and {tgt} have the same name: the kept pairs would be one file")
    existing = [str(p) for p in outputs if p.exists()]
    if existing:
        raise DataError(f"{existing[0]} exists: choose another --output-dir (outputs are never overwritten)")
    output_dir.mkdir(parents=True, exist_ok=True)
    filters = settings.filters()
    report = new_report(f"{src} / {tgt}", filters, (settings.src_lang, settings.tgt_lang))
    fit(filters, lambda: _pairs(src, tgt))
    tmp = [p.with_name(f".{p.name}.{os.getpid()}.tmp") for p in outputs[:3]]
    try:
        with open(tmp[0], "w") as kept_src, open(tmp[1], "w") as kept_tgt, open(tmp[2], "w") as rejected:
            rejected.write("line\trejected_by\tsrc\ttgt\n")
            for line, (s, t, reasons) in enumerate(judge(_pairs(src, tgt), filters, report), start=1):
                if reasons:
                    rejected.write(f"{line}\t{','.join(reasons)}\t{s}\t{t}\n")
                else:
                    kept_src.write(f"{s}\n")
                    kept_tgt.write(f"{t}\n")
        report.check_kept()
        report.write(outputs[3])
        for done, final in zip(tmp, outputs):
            os.replace(done, final)
    finally:
        for path in tmp:
            path.unlink(missing_ok=True)
    return report


def _pairs(src: Path, tgt: Path) -> Iterator[tuple[str, str]]:
    """The files' lines side by side (tabs inside a line become spaces: rejected.tsv stays four columns);
    DataError naming both files when one ends first."""
    src_lines, tgt_lines = iter_lines(src), iter_lines(tgt)
    for lines, (s, t) in enumerate(zip_longest(src_lines, tgt_lines)):
        if s is None or t is None:
            n_src = lines + (s is not None) + sum(1 for _ in src_lines)
            n_tgt = lines + (t is not None) + sum(1 for _ in tgt_lines)
            raise DataError(f"{src} / {tgt}: source has {n_src} lines but target has {n_tgt} (misaligned)")
        yield s.replace("\t", " "), t.replace("\t", " ")


def _config(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as err:
        raise DataError(f"cannot read --config {path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise DataError(f"--config {path} is not YAML: {' '.join(str(err).split())}") from None
    if not isinstance(loaded, dict):
        raise DataError(f"--config {path} must be a mapping of filter -> settings, got {loaded!r}")
    return loaded


def _plain_name(path: Path) -> str:
    return path.name.removesuffix(".gz")


def _suffix_lang(path: Path) -> str:
    """The two-letter language code a `{split}.{lang}[.gz]` file name ends with (e.g. train.de.gz)."""
    suffix = Path(_plain_name(path)).suffix.lstrip(".")
    if not (suffix.isalpha() and suffix.isascii() and len(suffix) == 2):
        raise DataError(f"cannot tell the language of {path} from its name: pass --src-lang / --tgt-lang")
    return suffix


if __name__ == "__main__":
    main()
