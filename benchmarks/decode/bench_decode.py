"""Decoding speed: our KV-cached beam search vs MarianMTModel.generate, KV-cached greedy vs recomputing.

Both models are randomly initialised with the same architecture (benchmarks/common/references.py) and decode
the same source batch (64 sentences of 10-32 tokens, vocab 10k). The work is fixed: every sentence gets
exactly `--length` target tokens, the last one EOS. Ours: `max_len_a=0, max_len_b=length` forces EOS at
that length (a random model almost never picks EOS earlier; mean lengths are printed to show it).
Marian: `min_new_tokens = max_new_tokens = length` with `forced_eos_token_id`, `early_stopping=False`.
Length penalty: ours is GNMT's ((5 + len) / 6) ** alpha, Hugging Face's len ** alpha; with every
hypothesis of the same length neither changes the ranking, so alpha = 0.6 for both.
Greedy: `greedy_search` (KV cache, finished sentences leave the batch) vs the same loop recomputing the
decoder over the whole prefix at every step; both must give the same tokens.
Repeats are interleaved (the order rotates) and medians reported, in sentences/s.
`--device cuda` times on a GPU (synchronized around each call); `--bf16` casts both models to bfloat16.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.decode.bench_decode [--cases d256,d512] [--repeats 3]
        [--device cuda] [--bf16]

`--export-ckpt CKPT --data-dir DIR`: deployment speed of a trained translation checkpoint instead. The
checkpoint is exported (`transformer.interop`) to CTranslate2 float32 and int8 and to transformers
(MarianMTModel), and each decodes the same Multi30k split (default test_2016_flickr) in the same
length-sorted batches with the same threads, beam size and alpha (the checkpoint's test decoding), the
methods interleaved round by round: sentences/s (median of rounds), speed relative to ours, BLEU of
each (sacreBLEU, as evaluate.py scores), and the share of sentences identical to ours; greedy search
likewise. CTranslate2 runs as one deploys it on a few CPU cores: as many batches at once as threads,
one thread each (`inter_threads=threads, intra_threads=1`: its workers share nothing, so they scale
with cores where one batch on all threads waits at every layer); int8 also runs one batch at a time
on all threads (`intra_threads=threads`), for comparison. Ours decodes one batch at a time on all
threads (torch's intra-op threads), as evaluate.py does: the same thread total. Each float32 export's
beam-search differences from ours are sorted by cause (`report.explain_differences`). Tokenization
is outside the timed calls; each method gets token ids or subword strings in and gives them back.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.decode.bench_decode --export-ckpt CKPT \
        --data-dir $MULTI30K_DIR [--split test_2016_flickr] [--repeats 3] [--threads 2]

`--smoke`: `--quick` (a batch of 4, 6 tokens, one round; 16 sentences with `--export-ckpt`) at a tiny
shape (the "smoke" case), a check of the code path.

The parts: common/timing.py (interleaved rounds, paired ratios), deploy.py (the runners of
--export-ckpt: ours, CTranslate2, transformers), report.py (its table).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning under load

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from benchmarks.common.references import (
    BOS,
    EOS,
    LENGTH_PENALTY,
    PAD,
    MarianReference,
    load_revision,
    make_batches,
    marian_generate,
    mean_length,
)  # fmt: skip
from benchmarks.common.timing import interleaved, paired_ratio
from benchmarks.decode.deploy import deploy_methods, length_batches, load_split
from benchmarks.decode.report import deploy_table
from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer
from transformer.search.decoding import beam_search, greedy_search, sample
from transformer.search.ensemble import Ensemble

CASES = {
    "d256": {"d_model": 256, "n_heads": 4, "n_encoder_layers": 3, "n_decoder_layers": 3, "d_ff": 1024},
    "d512": {"d_model": 512, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6, "d_ff": 2048},
    "smoke": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64},
}
VOCAB = 10_000


def recompute_greedy(model: Seq2SeqTransformer, src: Tensor, max_length: int) -> Tensor:
    """Greedy decoding without a cache: the decoder runs over the whole prefix at every step."""
    with torch.no_grad():
        memory = model.encode(src)
        src_mask = model.padding_mask(src)
        tgt_in = src.new_full((src.size(0), 1), BOS)
        finished = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for step in range(max_length):
            log_probs = model.decode(tgt_in, memory, src_mask)[:, -1].float().log_softmax(-1)  # (B, V)
            log_probs[:, [PAD, BOS]] = -math.inf
            token = (
                log_probs.argmax(-1)
                if step < max_length - 1
                else torch.full_like(finished, EOS, dtype=torch.long)
            )
            token = token.masked_fill(finished, PAD)
            tgt_in = torch.cat([tgt_in, token[:, None]], dim=1)
            finished |= token == EOS
            if finished.all():
                break
    return tgt_in[:, 1:]


def _methods(
    ours: Seq2SeqTransformer,
    marian: MarianReference,
    src: Tensor,
    n: int,
    before: tuple | None,
    ensemble: Ensemble,
) -> dict[str, Callable[[], Tensor]]:
    """The decoders to time, each producing (B, L) tokens without BOS for `src`, `n` tokens each.

    `before`: (revision, model, decoding module) of our code at an earlier revision, timed alongside;
    `ensemble`: ours and a second model of the same shape, decoded as one.
    """
    beam = {"beam_size": 4, "length_penalty": LENGTH_PENALTY, "max_len_a": 0, "max_len_b": n}
    draws = torch.Generator(device=src.device).manual_seed(0)
    methods = {
        "ours beam4 (KV cache)": lambda: beam_search(ours, src, **beam)[0][:, 0],
        "marian generate beam4": lambda: marian_generate(marian, src, n, beams=4),
        "ours greedy (KV cache)": lambda: greedy_search(ours, src, max_len_a=0, max_len_b=n),
        "ours greedy recompute": lambda: recompute_greedy(ours, src, n),
        "marian generate greedy": lambda: marian_generate(marian, src, n, beams=1),
        "ours sample top-k 10": lambda: sample(
            ours, src, top_k=10, max_len_a=0, max_len_b=n, generator=draws
        )[0][:, 0],
        "ours ensemble of 2 beam4": lambda: beam_search(ensemble, src, **beam)[0][:, 0],
    }
    if before is not None:
        revision, model, decoding = before
        methods[f"ours@{revision} beam4"] = lambda: decoding.beam_search(model, src, **beam)[0][:, 0]
        methods[f"ours@{revision} greedy"] = lambda: decoding.greedy_search(
            model, src, max_len_a=0, max_len_b=n
        )
    return methods


# --- random models of the same architecture (the default) ---------------------------------------------------


def _models(
    case: str, device: torch.device, dtype: torch.dtype, revision: dict | None, baseline: str | None
) -> tuple[Seq2SeqTransformer, MarianReference, tuple | None, Ensemble]:
    """Ours and Marian for `case`, (revision, model, decoding module) of our code at `baseline` with the
    same weights as ours, and an ensemble of ours and a second model of the same shape."""
    config = TransformerConfig(src_vocab_size=VOCAB, max_len=256, **CASES[case])  # type: ignore[arg-type]
    torch.manual_seed(0)
    ours = Seq2SeqTransformer(config).eval().to(device, dtype)
    marian = MarianReference(config).eval().to(device, dtype)
    torch.manual_seed(1)
    ensemble = Ensemble([ours, Seq2SeqTransformer(config).eval().to(device, dtype)])
    before = None
    if revision is not None:
        old_config = revision["config"].TransformerConfig(**vars(config))
        torch.manual_seed(0)  # the same weights as `ours`
        before = (
            baseline,
            revision["model"].Seq2SeqTransformer(old_config).eval().to(device, dtype),
            revision["decoding"],
        )
    return ours, marian, before, ensemble


def _pairs(baseline: str | None) -> dict[str, tuple[str, str]]:
    """The paired ratios reported per case: key -> (faster, slower) method."""
    pairs = {
        "beam4_ours_vs_marian": ("ours beam4 (KV cache)", "marian generate beam4"),
        "greedy_cached_vs_recompute": ("ours greedy (KV cache)", "ours greedy recompute"),
        "greedy_ours_vs_marian": ("ours greedy (KV cache)", "marian generate greedy"),
        # the cost of sampling (top-k 10) over greedy search, and of a 2-model ensemble over one model
        "greedy_vs_sample": ("ours greedy (KV cache)", "ours sample top-k 10"),
        "beam4_single_vs_ensemble2": ("ours beam4 (KV cache)", "ours ensemble of 2 beam4"),
    }
    if baseline is not None:
        pairs["beam4_ours_vs_before"] = ("ours beam4 (KV cache)", f"ours@{baseline} beam4")
        pairs["greedy_ours_vs_before"] = ("ours greedy (KV cache)", f"ours@{baseline} greedy")
    return pairs


def _case(
    case: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, revision: dict | None
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Time one case, print its rows and paired ratios; return the rows and the ratios (keys `case_pair`)."""
    ours, marian, before, ensemble = _models(case, device, dtype, revision, args.baseline)
    src = make_batches(1, args.batch_size, VOCAB, torch.Generator().manual_seed(1))[0].src.to(device)
    methods = _methods(ours, marian, src, args.length, before, ensemble)
    times, outputs = interleaved(methods, args.repeats, device)
    cached, recomputed = outputs["ours greedy (KV cache)"], outputs["ours greedy recompute"]
    if not torch.equal(cached, recomputed[:, : cached.size(1)]):
        raise RuntimeError("KV-cached greedy search and recomputation disagree")
    rows = {}
    for name, seconds in times.items():
        sent_s = args.batch_size / statistics.median(seconds)
        rows[name] = {"sent_s": sent_s, "mean_length": mean_length(outputs[name])}
        print(f"{case:6} {name:24} {sent_s:8.2f} {rows[name]['mean_length']:9.1f}")
    pairs = _pairs(args.baseline if before is not None else None)
    ratios = {f"{case}_{key}": paired_ratio(times, faster, slower) for key, (faster, slower) in pairs.items()}
    print("  paired ratios (median over rounds): " + ", ".join(
        f"{key} {ratios[f'{case}_{key}']:.2f}" for key in pairs
    ))  # fmt: skip
    return rows, ratios


def synthetic_benchmark(args: argparse.Namespace) -> None:
    """The default: ours vs Marian and cached vs recomputed greedy on random models (see the top)."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    revision = load_revision(args.baseline) if args.baseline else None
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.batch_size, args.length, args.repeats = 4, 6, 1

    load = os.getloadavg()
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, {where}, {str(dtype).removeprefix('torch.')}, "
        f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY')}, load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; "
        f"{args.batch_size} sentences x {args.length} tokens, sentences/s (median of {args.repeats})"
    )
    result: dict[str, object] = {"benchmark": "bench_decode", "torch": torch.__version__, "device": where,
                                 "dtype": str(dtype).removeprefix("torch."),
                                 "threads": torch.get_num_threads(), "load_start": load[0]}  # fmt: skip
    ratios: dict[str, float] = {}
    print(f"{'case':6} {'method':24} {'sent/s':>8} {'mean len':>9}")
    for case in args.cases.split(","):
        rows, case_ratios = _case(case, args, device, dtype, revision)
        ratios.update(case_ratios)
        result[case] = {name: {k: round(v, 2) for k, v in row.items()} for name, row in rows.items()}
    result["load_end"] = os.getloadavg()[0]
    result["ratios"] = {key: round(value, 3) for key, value in ratios.items()}
    print(json.dumps(result))


# --- a trained checkpoint and its exports (--export-ckpt) ---------------------------------------------------


def deploy_benchmark(args: argparse.Namespace) -> None:
    """--export-ckpt: ours vs CTranslate2 float32 / int8 vs transformers on a real split (see the top)."""
    import tempfile

    from transformer.interop.source import load_source

    source = load_source(args.export_ckpt)
    texts, references = load_split(args.data_dir, args.split, source.run_config, args.quick)
    args.repeats = 1 if args.quick else args.repeats
    threads = torch.get_num_threads()
    step = args.sentences_per_batch
    batches = length_batches(texts, step)
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, cpu, float32, {threads} threads (CTranslate2: inter_threads={threads}, "
        f"intra_threads=1, rows '1x{threads} thr': intra_threads={threads}), "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
        f"load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; "
        f"{args.export_ckpt}: {len(texts)} sentences of {args.split} in batches of {step}, "
        f"decoding {dict(source.decoding)}; sentences/s (median of {args.repeats})"
    )
    with tempfile.TemporaryDirectory() as tmp:
        methods = deploy_methods(source, batches, Path(tmp), threads)
        for method in methods.values():
            method(first=1)  # warm-up: first-call allocations, lazy initialization
        times, outputs = interleaved(methods, args.repeats)
    rows = deploy_table(source, texts, references, times, outputs)
    print(json.dumps({
        "benchmark": "bench_decode_export", "checkpoint": str(args.export_ckpt), "split": args.split,
        "sentences": len(texts), "threads": threads, "torch": torch.__version__, "load_start": load[0],
        "load_end": os.getloadavg()[0], "decoding": dict(source.decoding), "methods": rows,
    }))  # fmt: skip


# --- command line -------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="d256,d512", help="comma-separated subset of " + ",".join(CASES))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--length", type=int, default=40, help="target tokens per sentence, EOS included")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--baseline", default=None, help="git revision of our code to time alongside")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16", action="store_true", help="both models in bfloat16 (for GPUs)")
    parser.add_argument("--quick", action="store_true", help="tiny run: checks that the script works")
    parser.add_argument("--smoke", action="store_true", help="--quick at the smoke case's tiny shape")
    parser.add_argument("--export-ckpt", default=None, help="a translation checkpoint: time its exports")
    parser.add_argument("--data-dir", default=None, help="with --export-ckpt: a Multi30k data/task1/raw dir")
    parser.add_argument("--split", default="test_2016_flickr", help="with --export-ckpt: the split to decode")
    parser.add_argument("--sentences-per-batch", type=int, default=64, help="with --export-ckpt")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.quick = True
        args.cases = args.cases if args.export_ckpt else "smoke"
    if args.export_ckpt:
        if not args.data_dir:
            parser.error("--export-ckpt needs --data-dir (a Multi30k data/task1/raw directory)")
        if args.threads:
            torch.set_num_threads(args.threads)
        deploy_benchmark(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, but torch.cuda.is_available() is False here")
    synthetic_benchmark(args)


if __name__ == "__main__":
    main()
