"""Data preparation at scale: corpora of 100k, 1M and 4.5M pairs through train.py, ours against a baseline.

Corpora are built deterministically from Multi30k's training sentences (each line joins 1-3 random training
pairs; numpy seed 0) in the Multi30k layout, with Multi30k's own val and test files, in a temporary
directory (or `--corpora-dir`, reused when already complete; never commit them). Multi30k itself (and
SST-2 with `--sst2-dir`) are measured too, for "nothing else got slower". Every measurement is a real
`python train.py experiment=multi30k_de_en data.data_dir=CORPUS ...` process (`experiment=sst2` for SST-2),
each corpus and version with its own empty cache dir:

- empty cache: a training run (`trainer.max_steps=5 test=false`), start of the process -> first training
  step: reading, tokenizer training and tokenizing included;
- prepared: the same run again (ours memory-maps the cache; the baseline re-reads and re-tokenizes, only
  its tokenizer was cached): start -> first training step, peak RSS (ru_maxrss) and RssAnon at exit;
- prepare step (ours): `train=false test=false` on an empty cache (tokenizer + every split): wall time;
- cache on disk: after the prepare step;
- ddp: a `trainer=ddp_cpu` run (2 processes) on an empty cache: each rank's peak RSS, how many examples
  it tokenized and how many tokenizers it trained.

    python -m benchmarks.data.bench_data --baseline 859cf18 --multi30k-dir ../shared/data/multi30k \
        [--sst2-dir ../shared/data/sst2] [--sizes 100000,1000000,4500000] [--baseline-sizes 100000,1000000] \
        [--ddp-size 1000000] [--corpora-dir DIR] [--steps 5] [--quick | --smoke]

Prints a table, then one JSON line. The baseline is a `git worktree` of `--baseline` in a temporary directory.
Each measured process runs train.py through the probe in probe.py (run by its path, the measured
repository first on PYTHONPATH). `--smoke`: one corpus of 2k pairs, ours only, one step, no second run
on the prepared cache, no DDP run, the real corpora not measured: a check of the code path.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common.machine import cpu_name

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().with_name("probe.py")  # run by its path: it runs the measured train.py
RECIPE = "join 1-3 random Multi30k training pairs per line, numpy default_rng(0)"
MULTI30K_PAIRS, SST2_EXAMPLES = 29_000, 67_349  # training examples of the real corpora


@dataclass(frozen=True)
class Corpus:
    name: str
    experiment: str
    path: Path
    pairs: int


# -- the benchmark --------------------------------------------------------------------------------------
def build_corpus(multi30k: Path, pairs: int, directory: Path) -> Path:
    """`pairs` lines of 1-3 joined Multi30k training pairs (de, en) + Multi30k's val and test files."""
    stamp = directory / ".complete"
    recipe = {"pairs": pairs, "recipe": RECIPE, "source": str(multi30k.resolve())}
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    sentences = {}
    for lang in ("de", "en"):
        with gzip.open(multi30k / f"train.{lang}.gz", "rt", encoding="utf-8") as handle:
            sentences[lang] = [line.strip() for line in handle]
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 4, size=pairs)
    picks = rng.integers(0, len(sentences["de"]), size=int(counts.sum()))
    ends = np.cumsum(counts)
    for lang, lines in sentences.items():
        with gzip.open(directory / f"train.{lang}.gz", "wt", encoding="utf-8", compresslevel=1) as handle:
            for start, end in zip((ends - counts).tolist(), ends.tolist()):
                handle.write(" ".join(lines[i] for i in picks[start:end].tolist()) + "\n")
    for split in ("val", "test_2016_flickr"):
        for lang in ("de", "en"):
            shutil.copyfile(multi30k / f"{split}.{lang}.gz", directory / f"{split}.{lang}.gz")
    stamp.write_text(json.dumps(recipe))
    return directory


def measure(repo: Path, corpus: Corpus, cache_dir: Path, work: Path, *overrides: str) -> dict[str, Any]:
    """One train.py process (and its DDP children): wall time, and each process's report."""
    out = Path(tempfile.mkdtemp(dir=work, prefix="reports-"))
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix="run-"))
    env = {
        **os.environ,
        "BENCH_DATA_OUT": str(out),
        "BENCH_DATA_REPO": str(repo),
        "PROJECT_ROOT": str(repo),
        # the measured repository's packages (`data`, `transformer`) before any installed ones
        "PYTHONPATH": os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "OMP_WAIT_POLICY": "PASSIVE",
        "WANDB_MODE": "disabled",
    }
    command = [
        sys.executable,
        str(PROBE),
        f"experiment={corpus.experiment}",
        f"data.data_dir={corpus.path}",
        f"paths.cache_dir={cache_dir}",
        f"hydra.run.dir={run_dir}",
        "logger=csv",
        "optimized_metric=null",
        "+callbacks.bench_first_step._target_=__main__.FirstStepTimer",
        *overrides,
    ]
    start = time.time()
    done = subprocess.run(command, env=env, cwd=repo, capture_output=True, text=True)
    wall = time.time() - start
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"wall_s": wall, "ranks": ranks}


def disk_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def bench_corpus(
    name: str, repo: Path, corpus: Corpus, work: Path, steps: int, smoke: bool = False
) -> dict[str, Any]:
    """A training run on an empty cache, the same run again (not with `smoke`: the first run's figures
    stand in), and (ours) the preprocess step alone."""
    cache_dir = Path(tempfile.mkdtemp(dir=work, prefix=f"cache-{name}-"))
    train = [f"trainer.max_steps={steps}", "test=false"]
    cold = measure(repo, corpus, cache_dir, work, *train)["ranks"][0]
    warm = cold if smoke else measure(repo, corpus, cache_dir, work, *train)["ranks"][0]
    row: dict[str, Any] = {
        "version": name,
        "corpus": corpus.name,
        "pairs": corpus.pairs,
        "cold_first_step_s": cold["first_step_s"],
        "cold_pairs_per_s": corpus.pairs / cold["first_step_s"],
        "cold_peak_rss_mb": cold["peak_rss_mb"],
        "first_step_s": warm["first_step_s"],
        "peak_rss_mb": warm["peak_rss_mb"],
        "rss_anon_mb": warm["rss_anon_mb"],
        "tokenized": warm["tokenized"],
        "data_package": warm["data_package"],
    }
    if name == "ours":
        shutil.rmtree(cache_dir, ignore_errors=True)
        prepared = measure(repo, corpus, cache_dir, work, "train=false", "test=false")
        row.update(prepare_s=prepared["wall_s"], prepare_pairs_per_s=corpus.pairs / prepared["wall_s"])
    row["cache_mb"] = disk_mb(cache_dir)
    shutil.rmtree(cache_dir, ignore_errors=True)
    print(f"  {name} {corpus.name}: {json.dumps(row)}", flush=True)
    return row


def bench_ddp(name: str, repo: Path, corpus: Corpus, work: Path, steps: int) -> dict[str, Any]:
    cache_dir = Path(tempfile.mkdtemp(dir=work, prefix=f"cache-ddp-{name}-"))
    run = measure(
        repo, corpus, cache_dir, work, "trainer=ddp_cpu", f"trainer.max_steps={steps}", "test=false"
    )
    shutil.rmtree(cache_dir, ignore_errors=True)
    row = {"version": name, "corpus": corpus.name, "wall_s": run["wall_s"], "ranks": run["ranks"]}
    print(f"  ddp {name} {corpus.name}: {json.dumps(row)}", flush=True)
    return row


def bench_tokenize(multi30k: Path, corpus: Path, pairs: int, rounds: int = 2) -> dict[str, Any]:
    """The first `pairs` pairs of `corpus`'s train split through `data.prepare.tokenize_split`, encoded by
    `tokenizers`' own batch encoding (Rust, its threads) or by `CorpusEncoder` in 1 or one process per
    core; pairs/s (best of `rounds`, interleaved). Tokenizer: joint BPE 8k trained on Multi30k's train set.
    """
    from data import prepare, sources
    from data.tokenization import CorpusEncoder, train_bpe

    def texts(lang: str) -> list[str]:
        with gzip.open(multi30k / f"train.{lang}.gz", "rt", encoding="utf-8") as handle:
            return [line.strip() for line in handle]

    tokenizer = train_bpe(texts("de") + texts("en"), 8000)
    raw = sources.load_parallel(corpus / "train.de.gz", corpus / "train.en.gz").select(range(pairs))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def run(encoder: Any, workers: int) -> float:
        def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
            return {
                "src_ids": encoder.encode_batch(batch["src"]),
                "tgt_ids": encoder.encode_batch(batch["tgt"]),
            }

        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            prepare.tokenize_split(
                raw, encode, ("src", "tgt"), ("src_ids", "tgt_ids"), max_len=128, drop_long=True,
                dtype="uint16", directory=Path(out), workers=workers,
            )  # fmt: skip
            return pairs / (time.perf_counter() - start)

    results: dict[str, float] = {}
    for _ in range(rounds):
        for name, make, workers in (
            ("tokenizers encode_batch (Rust threads), 1 process", lambda: tokenizer, 1),
            ("CorpusEncoder, 1 process", lambda: CorpusEncoder(tokenizer), 1),
            (f"CorpusEncoder, {cores} forked processes", lambda: CorpusEncoder(tokenizer), cores),
        ):
            results[name] = max(results.get(name, 0.0), run(make(), workers))
    print(f"  tokenize {pairs} pairs: {json.dumps(results)}", flush=True)
    return {"pairs": pairs, "pairs_per_s": results}


def _size(pairs: int) -> str:
    return f"{pairs / 1e6:g}M" if pairs >= 10**6 else f"{pairs // 1000}k"


def print_table(
    rows: list[dict[str, Any]], ddp: list[dict[str, Any]], tokenize: dict[str, Any] | None
) -> None:
    print()
    columns = [
        "corpus", "version", "prepare step", "pairs/s", "start -> first step, empty cache", "pairs/s",
        "start -> first step, prepared", "peak RSS, prepared", "RssAnon at exit", "cache on disk",
    ]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for r in rows:
        ours = "prepare_s" in r
        cells = [
            r["corpus"],
            r["version"],
            f"{r['prepare_s']:.1f} s" if ours else "-",
            f"{r['prepare_pairs_per_s']:,.0f}" if ours else "-",
            f"{r['cold_first_step_s']:.1f} s",
            f"{r['cold_pairs_per_s']:,.0f}",
            f"{r['first_step_s']:.1f} s",
            f"{r['peak_rss_mb']:,.0f} MB",
            f"{r['rss_anon_mb']:,.0f} MB",
            f"{r['cache_mb']:,.0f} MB" if ours else "-",
        ]
        print("| " + " | ".join(cells) + " |")
    if tokenize:
        print(f"\nTokenizing {tokenize['pairs']:,} pairs of the train split (pairs/s, best of 2):")
        for name, rate in tokenize["pairs_per_s"].items():
            print(f"- {name}: {rate:,.0f}")
    for d in ddp:
        ranks = "; ".join(
            f"rank {r['rank']}: peak RSS {r['peak_rss_mb']:,.0f} MB, tokenized {r['tokenized']:,} examples, "
            f"trained {r['tokenizers_trained']} tokenizer(s)"
            for r in d["ranks"]
        )
        print(f"\nddp_cpu, {d['corpus']}, {d['version']} (empty cache, wall {d['wall_s']:.0f} s): {ranks}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--multi30k-dir", type=Path, default=os.environ.get("MULTI30K_DIR"))
    parser.add_argument("--sst2-dir", type=Path, default=os.environ.get("SST2_DIR"), help="adds SST-2 rows")
    parser.add_argument("--baseline", default=None, help="git revision measured as the baseline")
    parser.add_argument("--sizes", default="100000,1000000,4500000")
    parser.add_argument(
        "--baseline-sizes", default="100000,1000000", help="the baseline at 4.5M needs ~12 GB"
    )
    parser.add_argument("--ddp-size", type=int, default=1_000_000, help="0: no DDP run")
    parser.add_argument("--corpora-dir", type=Path, default=None, help="keep (and reuse) the corpora here")
    parser.add_argument("--steps", type=int, default=5, help="training steps of each training run")
    parser.add_argument("--tokenize-pairs", type=int, default=300_000, help="0: no tokenizer comparison")
    parser.add_argument("--quick", action="store_true", help="10k and 30k pairs only (a check of the script)")
    parser.add_argument("--smoke", action="store_true", help="2k pairs, ours only, no real corpora or DDP")
    args = parser.parse_args(argv)
    if args.multi30k_dir is None:
        raise SystemExit("error: --multi30k-dir (or $MULTI30K_DIR) must point at Multi30k's data/task1/raw")
    args.multi30k_dir = args.multi30k_dir.resolve()  # the runs start in the baseline's directory too
    args.sst2_dir = args.sst2_dir and args.sst2_dir.resolve()
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.baseline_sizes = [int(s) for s in args.baseline_sizes.split(",") if s]
    if args.quick:
        args.sizes, args.baseline_sizes, args.ddp_size = [10_000, 30_000], [10_000], 10_000
        args.tokenize_pairs = min(args.tokenize_pairs, 10_000)
    if args.smoke:
        args.sizes, args.baseline, args.ddp_size, args.steps, args.sst2_dir = [2_000], None, 0, 1, None
        args.baseline_sizes = []  # no baseline: its default sizes built a 1M-pair corpus for nothing
        args.tokenize_pairs = min(args.tokenize_pairs, 2_000)
    return args


def run_all(
    args: argparse.Namespace, versions: dict[str, Path], work: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any] | None]:
    """Build the corpora, then every measurement: (corpus rows, DDP rows, tokenizer comparison)."""
    corpora = args.corpora_dir or work / "corpora"
    corpora_list = [
        *([] if args.smoke else [Corpus("Multi30k", "multi30k_de_en", args.multi30k_dir, MULTI30K_PAIRS)]),
        *([Corpus("SST-2", "sst2", args.sst2_dir, SST2_EXAMPLES)] if args.sst2_dir else []),
    ]
    rows, ddp, tokenize = [], [], None
    for pairs in sorted(set(args.sizes) | set(args.baseline_sizes) | ({args.ddp_size} - {0})):
        start = time.time()
        path = build_corpus(args.multi30k_dir, pairs, corpora / f"pairs-{pairs}")
        print(f"corpus of {pairs} pairs: {path} ({time.time() - start:.0f} s)", flush=True)
        corpora_list.append(Corpus(_size(pairs), "multi30k_de_en", path, pairs))
    if args.tokenize_pairs:
        source = next(c for c in corpora_list[::-1] if c.pairs >= args.tokenize_pairs)
        tokenize = bench_tokenize(args.multi30k_dir, source.path, args.tokenize_pairs)
    for corpus in corpora_list:
        for name, repo in versions.items():
            wanted = args.sizes if name == "ours" else args.baseline_sizes
            if corpus.pairs in wanted or corpus.name in ("Multi30k", "SST-2"):
                rows.append(bench_corpus(name, repo, corpus, work, args.steps, args.smoke))
            if corpus.pairs == args.ddp_size and corpus.name not in ("Multi30k", "SST-2"):
                ddp.append(bench_ddp(name, repo, corpus, work, args.steps))
    return rows, ddp, tokenize


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp:
        work = Path(tmp)
        versions = {"ours": REPO}
        if args.baseline:
            base = work / "baseline"
            add = ["git", "worktree", "add", "--detach", str(base), args.baseline]
            subprocess.run(add, cwd=REPO, check=True, capture_output=True)
            versions["baseline"] = base
        try:
            rows, ddp, tokenize = run_all(args, versions, work)
        finally:
            if args.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(work / "baseline")], cwd=REPO)
    print_table(rows, ddp, tokenize)
    summary = {"bench": "data", "cpu": cpu_name(), "baseline": args.baseline, "rows": rows, "ddp": ddp}
    print(json.dumps({**summary, "tokenize": tokenize}))


if __name__ == "__main__":
    main()
