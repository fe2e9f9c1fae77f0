"""Cleaning at scale: pairs/s and peak RSS of `python -m data.clean` on corpora of growing size, with and
without language identification (memory must not grow with the corpus, but for the duplicates filter's
8-byte digests).

The corpora are built from Multi30k train: each pair two random Multi30k pairs joined (a seeded draw, so
nearly all distinct), written to text files; each cleaning runs in a fresh process that reports its own
peak RSS. Prints a Markdown table, then one JSON line.

    python -m benchmarks.data.bench_clean_scale --data-dir $MULTI30K_DIR --pairs 100000 1000000
    python -m benchmarks.data.bench_clean_scale --smoke   # 2,000 pairs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common.machine import cpu_name
from data.clean import FILTERS
from data.sources import read_lines

# the child: clean the files with the filters given as JSON, report seconds, peak RSS and pairs kept
CHILD = """
import json, resource, sys, time
from pathlib import Path
from data.clean.cli import clean_files
src, tgt, out, config = sys.argv[1:5]
start = time.perf_counter()
report = clean_files(Path(src), Path(tgt), Path(out), json.loads(config))
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "peak_rss_mb": peak, "pairs": report.pairs, "kept": report.kept}))
"""


def _corpus(directory: Path, pairs: int, src: list[str], tgt: list[str], seed: int) -> tuple[Path, Path]:
    rng = random.Random(seed)
    paths = directory / f"corpus{pairs}.de", directory / f"corpus{pairs}.en"
    with open(paths[0], "w") as s_file, open(paths[1], "w") as t_file:
        for _ in range(pairs):
            a, b = rng.randrange(len(src)), rng.randrange(len(src))
            s_file.write(f"{src[a]} {src[b]}\n")
            t_file.write(f"{tgt[a]} {tgt[b]}\n")
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR", "/work/shared/data/multi30k"))
    parser.add_argument("--pairs", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="2,000 pairs")
    args = parser.parse_args(argv)
    sizes = [2_000] if args.smoke else args.pairs
    src = read_lines(f"{args.data_dir}/train.de.gz")
    tgt = read_lines(f"{args.data_dir}/train.en.gz")
    configs = {
        "every filter": {name: {} for name in FILTERS},
        "without langid": {name: {} for name in FILTERS if name != "langid"},
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pairs in sizes:
            files = _corpus(Path(tmp), pairs, src, tgt, args.seed)
            for name, config in configs.items():
                out = Path(tmp) / f"out-{pairs}-{len(config)}"
                done = subprocess.run(
                    [sys.executable, "-c", CHILD, *map(str, files), str(out), json.dumps(config)],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if done.returncode:
                    raise SystemExit(f"cleaning {pairs} pairs failed: {done.stderr[-2000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(
                    {
                        "pairs": pairs,
                        "filters": name,
                        "pairs_per_s": round(pairs / result["seconds"]),
                        "seconds": round(result["seconds"], 1),
                        "peak_rss_mb": round(result["peak_rss_mb"]),
                        "kept": result["kept"],
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress
            for path in files:
                path.unlink()
    print(f"CPU: {cpu_name()}; corpora of joined Multi30k train pairs (de -> en), python -m data.clean")
    print("| pairs | filters | pairs/s | seconds | peak RSS MB | kept |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['pairs']} | {r['filters']} | {r['pairs_per_s']} | {r['seconds']} | {r['peak_rss_mb']} "
            f"| {r['kept']} |"
        )
    print(json.dumps({"bench": "bench_clean_scale", "cpu": cpu_name(), "rows": rows}))


if __name__ == "__main__":
    main()
