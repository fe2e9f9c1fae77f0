"""`python serve.py` under load: dynamic batching against batch size 1, the torch backend against CTranslate2.

A bounded load generator on 127.0.0.1 (`clients.py`): `--clients` clients (64), each with one keep-alive
connection, send `--requests` (2,000) single-sentence POST /v1/translate requests, one after another,
the sentences those of Multi30k's val split (German, `$MULTI30K_DIR`) in file order (again from the start
after the last). For each backend, two servers in turn, each a fresh `python serve.py` process
(`server.py`) serving one model with the server's batching limits:

- "batch size 1": `batching.max_batch_tokens=1 batching.max_wait_ms=0`, every model call one request (the
  mean batch size, read from /metrics, says so): the reference, the same model's unbatched outputs;
- "dynamic": the defaults of configs/serve.yaml (a token budget of 4,096 source tokens, a 5 ms wait).

Each run reports sentences/s (answered requests / wall time), p50 / p95 / p99 latency (send to last
byte), the mean batch size (segments per model call), failed requests (any status but 200, or not sent
within `--limit-s`), mismatched ones (a translation other than batch size 1's for the same sentence and
backend) and the server's RSS: with the model loaded, after the warm-up (`--warmup` requests from as many
clients as the load, so that the largest batches have been allocated once: "start"), at the end and at
its peak. Batch size 1's own outputs are checked: the same sentence always gets the same translation,
and the torch backend's equal `Translator.translate([sentence])` in this process for the first
`--check` sentences. CTranslate2's outputs are also compared with torch's (greedy: the same tokens are
expected, item 5 of issue 64). Targets (issue 64, on the 2-core CPU): dynamic batching >= 3x the
sentences/s of batch size 1, p99 <= 2 s with dynamic batching, no failed or mismatched answer, the RSS
at the end within 10% of the start.

The model: `--ckpt PATH`, or by default a model of the `multi30k_de_en` recipe's shape (d_model 256, 3+3
layers, d_ff 1024, tied embeddings, a joint BPE of 8,000 tokens trained on Multi30k's training pairs:
`benchmarks.common.checkpoints.recipe_checkpoint`) with RANDOM weights. A decoding step costs what a
trained model's does, but the number of steps differs: a random model mostly decodes to the length limit
(1.2 x source + 10 tokens) or stops at once, where a trained one stops at its translation's length, so
measure a trained checkpoint (`--ckpt`) for numbers to quote. Decoding: greedy (`--beam-size`). Client
and server share the machine's cores.

    python -m benchmarks.serve.load --data-dir $MULTI30K_DIR [--ckpt PATH] [--requests 2000] \
        [--clients 64] [--backends torch,ctranslate2[,ctranslate2:int8]] \
        [--results-dir benchmarks/results/serve]

`--smoke`: a tiny random checkpoint (`smoke_checkpoint`), 48 requests from 8 clients, torch (and
CTranslate2 when the server has that backend).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.machine import cpu_name
from benchmarks.common.results import RESULTS_DIR, logged_stdout
from benchmarks.serve.clients import Load, run_load
from benchmarks.serve.server import MODEL_ID, RssSampler, Server

BATCH_SIZE_1 = {"max_batch_tokens": 1, "max_wait_ms": 0}  # one request per model call
DYNAMIC: dict[str, float] = {}  # configs/serve.yaml's batching defaults
TARGETS = {"speedup": 3.0, "p99_s": 2.0, "rss_growth": 0.10}  # issue 64, item 6


def _sentences(data_dir: Path) -> list[str]:
    with gzip.open(data_dir / "val.de.gz", "rt", encoding="utf-8") as handle:
        return [line.strip() for line in handle if line.strip()]


def _revision() -> str:
    """The checkout measured: its commit, and whether files differ from it."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[2])]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True).stdout
    except OSError:
        return "revision unknown"
    return f"at {commit.strip()}" + (" with uncommitted changes" if dirty.strip() else "")


def _ctranslate2_version() -> str:
    try:
        import ctranslate2
    except ImportError:
        return ""
    return f", ctranslate2 {ctranslate2.__version__}"


def _served_backends() -> tuple[str, ...]:
    from transformer.serving.config import BACKENDS

    return BACKENDS


def measure_one(
    args: argparse.Namespace, checkpoint: Path, backend: str, batching: dict, sentences: list[str], out: Path
) -> tuple[Load, dict[str, Any]]:
    """One server, warmed up, under the load: what came back, and the run's numbers."""
    options = {"beam_size": args.beam_size}
    with Server(checkpoint, backend, batching, out, cache_dir=out.parent / "ct2", decoding=options) as server:
        rss_loaded = server.rss_mb()
        # the warm-up as concurrent as the load, so that its batch sizes have been allocated once: what the
        # RSS does after it is what the run adds (a leak), not the first large batch
        warm = run_load(server.port, MODEL_ID, sentences, args.warmup, args.clients, options, 600)
        if warm.failed:
            raise RuntimeError(f"{backend}: the warm-up failed: {warm.errors}\n{server.log_tail()}")
        segments_before, calls_before = server.batch_counts()
        rss_start = server.rss_mb()
        with RssSampler(server) as rss:
            load = run_load(
                server.port, MODEL_ID, sentences, args.requests, args.clients, options, args.limit_s
            )
        segments, calls = server.batch_counts()
        rss_end = server.rss_mb()
    mean_batch = (segments - segments_before) / (calls - calls_before) if calls > calls_before else math.nan
    row = {
        "backend": backend,
        "batching": "batch size 1" if batching == BATCH_SIZE_1 else "dynamic",
        "requests": args.requests,
        "answered": len(load.translations),
        "sentences_per_s": len(load.translations) / load.wall_s if load.wall_s else math.nan,
        "p50_ms": load.percentile_ms(50),
        "p95_ms": load.percentile_ms(95),
        "p99_ms": load.percentile_ms(99),
        "mean_batch": mean_batch,
        "failed": load.failed,
        "statuses": {str(status): n for status, n in sorted(load.statuses.items())},
        "rss_loaded_mb": rss_loaded,
        "rss_start_mb": rss_start,
        "rss_end_mb": rss_end,
        "rss_peak_mb": max(rss.peak, rss_end),
        "wall_s": load.wall_s,
        "errors": load.errors,
    }
    return load, row


def _by_sentence(load: Load, sentences: list[str]) -> tuple[dict[str, str], int]:
    """Sentence -> its translation, and how many answers disagreed with an earlier one for the same
    sentence (an unbatched server must answer a sentence the same way every time)."""
    seen: dict[str, str] = {}
    inconsistent = 0
    for index, text in sorted(load.translations.items()):
        sentence = sentences[index % len(sentences)]
        if seen.setdefault(sentence, text) != text:
            inconsistent += 1
    return seen, inconsistent


def _mismatched(load: Load, reference: dict[str, str], sentences: list[str]) -> int:
    return sum(
        reference.get(sentences[index % len(sentences)], text) != text
        for index, text in load.translations.items()
    )


def _check_in_process(
    checkpoint: Path, reference: dict[str, str], sentences: list[str], n: int, beam: int
) -> int:
    """How many of the first `n` sentences batch size 1 translated otherwise than `Translator.translate` of
    the sentence alone in this process."""
    from transformer.inference import Translator

    translator = Translator.from_checkpoint(checkpoint)
    chosen = [s for s in dict.fromkeys(sentences) if s in reference][:n]
    return sum(translator.translate([s], beam_size=beam)[0].text != reference[s] for s in chosen)


def measure(args: argparse.Namespace, tmp: Path) -> None:
    import torch

    from benchmarks.common import checkpoints

    sentences = _sentences(Path(args.data_dir))
    if args.ckpt:
        checkpoint, model = Path(args.ckpt), f"checkpoint {args.ckpt}"
    elif args.smoke:
        checkpoint, model = checkpoints.smoke_checkpoint(tmp / "smoke.ckpt", args.data_dir), "smoke (random)"
    else:
        checkpoint = checkpoints.recipe_checkpoint(tmp / "recipe.ckpt", args.data_dir)
        model = "multi30k_de_en shape, random weights"
    served = _served_backends()
    backends = [b for b in args.backends if b.partition(":")[0] in served]
    missing = [b for b in args.backends if b.partition(":")[0] not in served]
    print(
        f"CPU: {cpu_name()}; torch {torch.__version__}{_ctranslate2_version()}; {_revision()}\n"
        f"model: {model}; {args.requests} requests from {args.clients} clients, Multi30k val "
        f"({len(sentences)} sentences), beam {args.beam_size}"
    )
    for backend in missing:
        print(f"backend {backend}: missing (this server's backends: {', '.join(served)}): not measured")
    rows, loads = [], {}
    for backend in backends:
        for batching in (BATCH_SIZE_1, DYNAMIC):
            name = f"{backend}_{'bs1' if batching == BATCH_SIZE_1 else 'dynamic'}"
            loads[name], row = measure_one(args, checkpoint, backend, batching, sentences, tmp / name)
            rows.append(row)
            print(
                f"  {name}: {row['sentences_per_s']:.1f} sentences/s, p99 {row['p99_ms']:.0f} ms", flush=True
            )
    references = {}
    for backend in backends:
        reference, inconsistent = _by_sentence(loads[f"{backend}_bs1"], sentences)
        references[backend] = reference
        for row in rows:
            if row["backend"] == backend:
                own = row["batching"] == "batch size 1"
                load = loads[f"{backend}_{'bs1' if own else 'dynamic'}"]
                row["mismatched"] = inconsistent if own else _mismatched(load, reference, sentences)
    checks: dict[str, Any] = {}
    if "torch" in references and args.check:
        checks["torch_bs1_vs_in_process"] = _check_in_process(
            checkpoint, references["torch"], sentences, args.check, args.beam_size
        )
    for backend in references:
        if backend != "torch" and "torch" in references:
            common = set(references["torch"]) & set(references[backend])
            same = sum(references["torch"][s] == references[backend][s] for s in common)
            checks[f"{backend}_same_as_torch"] = f"{same}/{len(common)} sentences"
    report(args, rows, checks, missing, model)


def _ratio(rows: list[dict], backend: str) -> float:
    speed = {row["batching"]: row["sentences_per_s"] for row in rows if row["backend"] == backend}
    return speed.get("dynamic", math.nan) / speed.get("batch size 1", math.nan)


def report(args: argparse.Namespace, rows: list[dict], checks: dict, missing: list[str], model: str) -> None:
    header = (
        f"{'backend':<16} {'batching':<13} {'sent/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} "
        f"{'batch':>6} {'failed':>6} {'mismatch':>8} {'RSS loaded/start/end/peak MB':>29}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        rss = f"{r['rss_loaded_mb']:.0f}/{r['rss_start_mb']:.0f}/{r['rss_end_mb']:.0f}/{r['rss_peak_mb']:.0f}"
        print(
            f"{r['backend']:<16} {r['batching']:<13} {r['sentences_per_s']:>8.1f} {r['p50_ms']:>8.0f} "
            f"{r['p95_ms']:>8.0f} {r['p99_ms']:>8.0f} {r['mean_batch']:>6.1f} {r['failed']:>6} "
            f"{r['mismatched']:>8} {rss:>29}"
        )
        if r["errors"]:
            print(f"    first errors: {r['errors']}")
    ratios = {backend: _ratio(rows, backend) for backend in dict.fromkeys(r["backend"] for r in rows)}
    for backend, ratio in ratios.items():
        print(
            f"dynamic / batch size 1, {backend}: {ratio:.2f}x sentences/s (target >= {TARGETS['speedup']}x)"
        )
    speed = {(r["backend"], r["batching"]): r["sentences_per_s"] for r in rows}
    for backend in ratios:
        for batching in ("batch size 1", "dynamic"):
            if backend != "torch" and (backend, batching) in speed and ("torch", batching) in speed:
                ratio = speed[backend, batching] / speed["torch", batching]
                print(f"{backend} / torch, {batching}: {ratio:.2f}x sentences/s")
    for name, value in checks.items():
        print(f"check {name}: {value}")
    dynamic = [r for r in rows if r["batching"] == "dynamic"]
    targets = {
        **{f"speedup_{backend}": ratio >= TARGETS["speedup"] for backend, ratio in ratios.items()},
        "p99": all(r["p99_ms"] <= 1000 * TARGETS["p99_s"] for r in dynamic),
        "no_failed_or_mismatched": all(r["failed"] == 0 and r["mismatched"] == 0 for r in rows)
        and checks.get("torch_bs1_vs_in_process", 0) == 0,
        "rss_flat": all(r["rss_end_mb"] <= (1 + TARGETS["rss_growth"]) * r["rss_start_mb"] for r in rows),
    }
    print("targets: " + ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in targets.items()))
    summary = {
        "benchmark": "serve.load",
        "cpu": cpu_name(),
        "model": model,
        "requests": args.requests,
        "clients": args.clients,
        "beam_size": args.beam_size,
        "missing_backends": missing,
        "rows": [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows
        ],
        "dynamic_over_bs1": {b: (None if math.isnan(v) else round(v, 3)) for b, v in ratios.items()},
        "checks": checks,
        "targets": targets,
    }
    print(json.dumps(summary))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR"), help="Multi30k data/task1/raw")
    parser.add_argument(
        "--ckpt", default=None, help="a translation checkpoint (default: random, recipe shape)"
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--backends",
        default="torch,ctranslate2",
        help="comma-separated: torch, ctranslate2, ctranslate2:COMPUTE_TYPE (e.g. ctranslate2:int8)",
    )
    parser.add_argument("--beam-size", type=int, default=1, help="1: greedy")
    parser.add_argument("--warmup", type=int, default=128, help="requests to each server before measuring")
    parser.add_argument("--check", type=int, default=64, help="sentences translated alone in this process")
    parser.add_argument("--limit-s", type=float, default=1200, help="time limit of one load run")
    parser.add_argument(
        "--results-dir", default=None, help=f"write the output there too (e.g. {RESULTS_DIR / 'serve'})"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny random model, 48 requests, 8 clients")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.data_dir is None:
        parser.error("--data-dir: no Multi30k directory given and $MULTI30K_DIR is not set")
    if args.smoke:
        args.requests, args.clients, args.warmup, args.check, args.limit_s = 48, 8, 8, 8, 300
    args.backends = [b.strip() for b in str(args.backends).split(",") if b.strip()]
    with logged_stdout() as log:
        if args.results_dir:
            day = datetime.date.today().isoformat()
            path = Path(args.results_dir) / f"{day}_cpu_serve_load.txt"
            log.open(path, f"python -m benchmarks.serve.load {' '.join(argv or sys.argv[1:])}")
        with tempfile.TemporaryDirectory() as tmp:
            measure(args, Path(tmp))


if __name__ == "__main__":
    main()
