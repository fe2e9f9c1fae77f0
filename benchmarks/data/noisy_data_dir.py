"""A Multi30k data directory whose train split is the noisy corpus of `noisy_corpus.py`.

Writes `train.{src,tgt}.gz` (the noisy pairs), `train.kinds.txt` (each line's kind of noise, or "clean")
and links val and test_2016_flickr to the clean originals, so that the directory is a
`data.source=multi30k` `data_dir`. Used for issue 66's measurement: the recipe trained on noisy data with
and without `data.clean` (docs/results.md).

    python -m benchmarks.data.noisy_data_dir --data-dir $MULTI30K_DIR --output-dir noisy_multi30k
    python -m benchmarks.data.noisy_data_dir --smoke   # the first 2,000 pairs, into a temporary directory

Prints one line and then a JSON line with the counts of each kind.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.data.noisy_corpus import make_noisy
from data.sources import read_lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR", "/work/shared/data/multi30k"))
    parser.add_argument("--output-dir", help="a new directory (never overwritten)")
    parser.add_argument("--src-lang", default="de")
    parser.add_argument("--tgt-lang", default="en")
    parser.add_argument("--third-lang", default="fr", help="the wrong language's sentences")
    parser.add_argument("--share", type=float, default=0.05, help="share of the pairs per kind of noise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help="the first 2,000 pairs, into a temporary directory"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as scratch:
            _write(args, Path(scratch) / "noisy", limit=2000)
    elif args.output_dir is None:
        parser.error("--output-dir is required (or --smoke)")
    else:
        _write(args, Path(args.output_dir))


def _write(args: argparse.Namespace, out: Path, limit: int | None = None) -> None:
    if out.exists():
        raise SystemExit(f"error: {out} exists; choose a new --output-dir")
    source = Path(args.data_dir).resolve()
    needed = [source / f"train.{lang}.gz" for lang in (args.src_lang, args.tgt_lang, args.third_lang)]
    needed += [
        source / f"{s}.{lang}.gz"
        for s in ("val", "test_2016_flickr")
        for lang in (args.src_lang, args.tgt_lang)
    ]
    missing = [path for path in needed if not path.is_file()]
    if missing:
        raise SystemExit(f"error: {missing[0]} is missing: --data-dir must hold Multi30k's gzipped files")
    texts = [
        read_lines(str(source / f"train.{lang}.gz"))
        for lang in (args.src_lang, args.tgt_lang, args.third_lang)
    ]
    rows = make_noisy(*(t[:limit] for t in texts), share=args.share, seed=args.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    # written in a fresh directory beside `out` and renamed into place: a crash leaves no half `out`, and
    # what an earlier crash left is this run's to ignore, never an error
    partial = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    try:
        _fill(args, source, rows, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(out)
    kinds = Counter(kind for _, _, kind in rows)
    print(f"wrote {out}: {len(rows)} train pairs, " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    print(
        json.dumps({"benchmark": "noisy_data_dir", "pairs": len(rows), "kinds": dict(sorted(kinds.items()))})
    )


def _fill(args: argparse.Namespace, source: Path, rows: list[tuple[str, str, str]], partial: Path) -> None:
    for column, lang in enumerate((args.src_lang, args.tgt_lang)):
        with gzip.open(partial / f"train.{lang}.gz", "wt", encoding="utf-8") as f:
            f.writelines(row[column].replace("\n", " ") + "\n" for row in rows)
    (partial / "train.kinds.txt").write_text("".join(kind + "\n" for _, _, kind in rows), encoding="utf-8")
    for split in ("val", "test_2016_flickr"):
        for lang in (args.src_lang, args.tgt_lang):
            (partial / f"{split}.{lang}.gz").symlink_to(source / f"{split}.{lang}.gz")


if __name__ == "__main__":
    main()
