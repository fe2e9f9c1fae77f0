"""Parallel-data cleaning on a noisy Multi30k: how much of each kind of injected noise the `data.clean`
filters remove, and how many clean pairs they lose.

Multi30k train (de -> en, French for the wrong language) with ten kinds of noise at 5% each
(`noisy_corpus.py`), cleaned with every filter at its default (configs/data/clean/default.yaml). Per kind:
the share removed by any filter and by the filter meant for it; for the clean pairs the share each filter
would remove. Also pairs/s of the whole chain and without language identification. Prints a Markdown
table, then one JSON line.

    python -m benchmarks.data.bench_clean --data-dir $MULTI30K_DIR
    python -m benchmarks.data.bench_clean --smoke   # the first 2,000 pairs
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from typing import Any

from benchmarks.common.machine import cpu_name
from benchmarks.data.noisy_corpus import KINDS, make_noisy
from data.clean import FILTERS, CleanSettings, PairFilter, fit, judge, new_report
from data.sources import read_lines

# the filter meant for each kind of noise (the one that must remove >= 95% of it)
OWN_FILTER = {
    "copies": "identical",
    "swapped": "langid",
    "wrong_language": "langid",
    "shuffled": "alignment",
    "duplicates": "duplicates",
    "numbers": "numbers",
    "markup": "markup",
    "truncation": "ratio",
    "repetition": "repetition",
    "overlong": "length",
}


def _results_by_kind(
    rows: list[tuple[str, str, str]], verdicts: list[list[str]], filters: list[PairFilter]
) -> list[dict[str, Any]]:
    """Per kind of noise (and the clean pairs): the share removed, the share its own filter removed, the
    first rejecting filters; for the clean pairs what each filter would remove."""
    results = []
    for kind in (*KINDS, "clean"):
        judged = [v for v, (_, _, k) in zip(verdicts, rows) if k == kind]
        own = OWN_FILTER.get(kind)
        row = {
            "kind": kind,
            "pairs": len(judged),
            "removed_pct": round(100 * sum(bool(v) for v in judged) / len(judged), 2),
            "own_filter": own,
            "own_filter_pct": None
            if own is None
            else round(100 * sum(own in v for v in judged) / len(judged), 2),
            "first": Counter(v[0] for v in judged if v).most_common(3),
        }
        if kind == "clean":
            row["per_filter_pct"] = {
                f.name: round(100 * sum(f.name in v for v in judged) / len(judged), 2) for f in filters
            }
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR", "/work/shared/data/multi30k"))
    parser.add_argument("--src-lang", default="de")
    parser.add_argument("--tgt-lang", default="en")
    parser.add_argument("--third-lang", default="fr", help="the wrong language's sentences")
    parser.add_argument("--share", type=float, default=0.05, help="share of the pairs per kind of noise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="the first 2,000 pairs")
    args = parser.parse_args(argv)
    texts = [
        read_lines(f"{args.data_dir}/train.{lang}.gz")
        for lang in (args.src_lang, args.tgt_lang, args.third_lang)
    ]
    if args.smoke:
        texts = [t[:2000] for t in texts]
    rows = make_noisy(*texts, share=args.share, seed=args.seed)
    pairs = [(s, t) for s, t, _ in rows]
    kinds = Counter(kind for _, _, kind in rows)

    settings = CleanSettings({name: {} for name in FILTERS}, args.src_lang, args.tgt_lang)
    filters = settings.filters()
    report = new_report("noisy multi30k", filters, (args.src_lang, args.tgt_lang))
    start = time.perf_counter()
    fit(filters, lambda: pairs)
    verdicts = [rejected for _, _, rejected in judge(pairs, filters, report)]
    seconds = time.perf_counter() - start
    no_langid = [
        f
        for f in CleanSettings(
            {n: {} for n in FILTERS if n != "langid"}, args.src_lang, args.tgt_lang
        ).filters()
    ]
    start = time.perf_counter()
    fit(no_langid, lambda: pairs)
    for _ in judge(pairs, no_langid, new_report("", no_langid, ("", ""))):
        pass
    seconds_no_langid = time.perf_counter() - start

    results = _results_by_kind(rows, verdicts, filters)

    print(
        f"CPU: {cpu_name()}; Multi30k train {args.src_lang}->{args.tgt_lang}, {len(rows)} pairs, "
        f"{args.share:.0%} per kind, seed {args.seed}"
    )
    print("| kind | pairs | removed % | its filter | removed by it % | first rejecting filters |")
    print("|---|---:|---:|---|---:|---|")
    for r in results:
        first = ", ".join(f"{name} {n}" for name, n in r["first"])
        own = "- | -" if r["own_filter"] is None else f"{r['own_filter']} | {r['own_filter_pct']}"
        print(f"| {r['kind']} | {r['pairs']} | {r['removed_pct']} | {own} | {first} |")
    clean = results[-1]["per_filter_pct"]
    print("\nclean pairs each filter would remove (%): " + ", ".join(f"{k} {v}" for k, v in clean.items()))
    print(
        f"pairs/s: {len(pairs) / seconds:.0f} (every filter), "
        f"{len(pairs) / seconds_no_langid:.0f} (without langid)"
    )
    print(
        json.dumps(
            {
                "bench": "bench_clean",
                "cpu": cpu_name(),
                "pairs": len(rows),
                "kinds": dict(kinds),
                "results": results,
                "pairs_per_s": round(len(pairs) / seconds),
                "pairs_per_s_without_langid": round(len(pairs) / seconds_no_langid),
            }
        )
    )


if __name__ == "__main__":
    main()
