"""Decoding speed: our KV-cached beam search vs MarianMTModel.generate, KV-cached greedy vs recomputing.

Both models are randomly initialised with the same architecture (benchmarks/references.py) and decode
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

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_decode.py [--cases d256,d512] [--repeats 3]
        [--device cuda] [--bf16]

`--export-ckpt CKPT --data-dir DIR`: deployment speed of a trained translation checkpoint instead. The
checkpoint is exported (`transformer.export`) to CTranslate2 float32 and int8 and to transformers
(MarianMTModel), and each decodes the same Multi30k split (default test_2016_flickr) in the same
length-sorted batches with the same threads, beam size and alpha (the checkpoint's test decoding), the
methods interleaved round by round: sentences/s (median of rounds), speed relative to ours, BLEU of
each (sacreBLEU, as evaluate.py scores), and the share of sentences identical to ours; greedy search
likewise. CTranslate2 runs as one deploys it on a few CPU cores: as many batches at once as threads,
one thread each (`inter_threads=threads, intra_threads=1`: its workers share nothing, so they scale
with cores where one batch on all threads waits at every layer); int8 also runs one batch at a time
on all threads (`intra_threads=threads`), for comparison. Ours decodes one batch at a time on all
threads (torch's intra-op threads), as evaluate.py does: the same thread total. Each float32 export's
beam-search differences from ours are sorted by cause (`_explain_differences`). Tokenization is
outside the timed calls; each method gets token ids or subword strings in and gives them back.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_decode.py --export-ckpt CKPT \
        --data-dir ../shared/data/multi30k [--split test_2016_flickr] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning under load

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from references import BOS, EOS, PAD, MarianReference, load_revision, make_batches

from transformer.config import TransformerConfig
from transformer.decoding import beam_search, greedy_search
from transformer.model import Seq2SeqTransformer

CASES = {
    "d256": {"d_model": 256, "n_heads": 4, "n_encoder_layers": 3, "n_decoder_layers": 3, "d_ff": 1024},
    "d512": {"d_model": 512, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6, "d_ff": 2048},
}
VOCAB = 10_000
LENGTH_PENALTY = 0.6


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


def marian_generate(marian: MarianReference, src: Tensor, length: int, beams: int) -> Tensor:
    """MarianMTModel.generate with exactly `length` new tokens per sentence -> (B, length) without BOS."""
    with torch.no_grad():
        out = marian.marian.generate(
            input_ids=src,
            attention_mask=src.ne(PAD),
            num_beams=beams,
            num_return_sequences=1,
            do_sample=False,
            max_new_tokens=length,
            min_new_tokens=length,
            use_cache=True,
            **({"length_penalty": LENGTH_PENALTY, "early_stopping": False} if beams > 1 else {}),
        )
    return out[:, 1:]  # drop the decoder start token


def _methods(
    ours: Seq2SeqTransformer, marian: MarianReference, src: Tensor, n: int, before: tuple | None
) -> dict[str, Callable[[], Tensor]]:
    """The decoders to time, each producing (B, L) tokens without BOS for `src`, `n` tokens each.

    `before`: (revision, model, decoding module) of our code at an earlier revision, timed alongside.
    """
    beam = {"beam_size": 4, "length_penalty": LENGTH_PENALTY, "max_len_a": 0, "max_len_b": n}
    methods = {
        "ours beam4 (KV cache)": lambda: beam_search(ours, src, **beam)[0][:, 0],
        "marian generate beam4": lambda: marian_generate(marian, src, n, beams=4),
        "ours greedy (KV cache)": lambda: greedy_search(ours, src, max_len_a=0, max_len_b=n),
        "ours greedy recompute": lambda: recompute_greedy(ours, src, n),
        "marian generate greedy": lambda: marian_generate(marian, src, n, beams=1),
    }
    if before is not None:
        revision, model, decoding = before
        methods[f"ours@{revision} beam4"] = lambda: decoding.beam_search(model, src, **beam)[0][:, 0]
        methods[f"ours@{revision} greedy"] = lambda: decoding.greedy_search(
            model, src, max_len_a=0, max_len_b=n
        )
    return methods


def interleaved(
    methods: dict[str, Callable[[], Tensor]],
    repeats: int,
    device: torch.device = torch.device("cpu"),  # noqa: B008
) -> tuple[dict[str, list[float]], dict[str, Tensor]]:
    """Seconds of each method in each of `repeats` rounds (the order rotates), and its last output;
    on a GPU each call is timed from an idle device to the end of its last kernel."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, Tensor] = {}
    for i in range(repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            sync()
            start = time.perf_counter()
            outputs[name] = methods[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    return times, outputs


def paired_ratio(times: dict[str, list[float]], faster: str, slower: str) -> float:
    """Median over rounds of slower/faster time: each round's pair ran minutes apart at most, so a
    change of load between rounds cancels out."""
    return statistics.median(s / f for f, s in zip(times[faster], times[slower]))


def mean_length(tokens: Tensor) -> float:
    """Mean tokens per hypothesis up to and including the first EOS (pads after it not counted)."""
    ended = tokens.eq(EOS).int().cumsum(1)  # (B, L): 1 from the first EOS on
    return float((ended.eq(0) | (ended.eq(1) & tokens.eq(EOS))).sum(1).float().mean())


def main() -> None:
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
    parser.add_argument("--export-ckpt", default=None, help="a translation checkpoint: time its exports")
    parser.add_argument("--data-dir", default=None, help="with --export-ckpt: a Multi30k data/task1/raw dir")
    parser.add_argument("--split", default="test_2016_flickr", help="with --export-ckpt: the split to decode")
    parser.add_argument("--sentences-per-batch", type=int, default=64, help="with --export-ckpt")
    args = parser.parse_args()
    if args.export_ckpt:
        if not args.data_dir:
            parser.error("--export-ckpt needs --data-dir (a Multi30k data/task1/raw directory)")
        if args.threads:
            torch.set_num_threads(args.threads)
        deploy_benchmark(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, but torch.cuda.is_available() is False here")
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
        config = TransformerConfig(src_vocab_size=VOCAB, max_len=256, **CASES[case])  # type: ignore[arg-type]
        torch.manual_seed(0)
        ours = Seq2SeqTransformer(config).eval().to(device, dtype)
        marian = MarianReference(config).eval().to(device, dtype)
        src = make_batches(1, args.batch_size, VOCAB, torch.Generator().manual_seed(1))[0].src.to(device)
        before = None
        if revision is not None:
            old_config = revision["config"].TransformerConfig(**vars(config))
            torch.manual_seed(0)  # the same weights as `ours`
            before = (
                args.baseline,
                revision["model"].Seq2SeqTransformer(old_config).eval().to(device, dtype),
                revision["decoding"],
            )
        times, outputs = interleaved(_methods(ours, marian, src, args.length, before), args.repeats, device)
        cached, recomputed = outputs["ours greedy (KV cache)"], outputs["ours greedy recompute"]
        if not torch.equal(cached, recomputed[:, : cached.size(1)]):
            raise RuntimeError("KV-cached greedy search and recomputation disagree")
        rows = {}
        for name, seconds in times.items():
            sent_s = args.batch_size / statistics.median(seconds)
            rows[name] = {"sent_s": sent_s, "mean_length": mean_length(outputs[name])}
            print(f"{case:6} {name:24} {sent_s:8.2f} {rows[name]['mean_length']:9.1f}")
        pairs = {
            "beam4_ours_vs_marian": ("ours beam4 (KV cache)", "marian generate beam4"),
            "greedy_cached_vs_recompute": ("ours greedy (KV cache)", "ours greedy recompute"),
            "greedy_ours_vs_marian": ("ours greedy (KV cache)", "marian generate greedy"),
        }
        if before is not None:
            pairs["beam4_ours_vs_before"] = ("ours beam4 (KV cache)", f"ours@{args.baseline} beam4")
            pairs["greedy_ours_vs_before"] = ("ours greedy (KV cache)", f"ours@{args.baseline} greedy")
        for key, (faster, slower) in pairs.items():
            ratios[f"{case}_{key}"] = paired_ratio(times, faster, slower)
        print("  paired ratios (median over rounds): " + ", ".join(
            f"{key} {ratios[f'{case}_{key}']:.2f}" for key in pairs
        ))  # fmt: skip
        result[case] = {name: {k: round(v, 2) for k, v in row.items()} for name, row in rows.items()}
    result["load_end"] = os.getloadavg()[0]
    result["ratios"] = {key: round(value, 3) for key, value in ratios.items()}
    print(json.dumps(result))


# --- a trained checkpoint and its exports (--export-ckpt) ---------------------------------------------------


def _deploy_methods(source, batches, tmp: Path, threads: int) -> dict[str, Callable[..., list[list[int]]]]:
    """The decoders to time on `batches` (lists of (index, text) of similar length), each returning the
    token ids (no BOS / EOS) of every sentence in split order; called with `first=k`, only the first k
    batches are decoded (a warm-up)."""
    import ctranslate2
    import tokenizers
    from transformers import AutoModelForSeq2SeqLM
    from transformers.utils import logging as hf_logging

    from transformer.export.ctranslate2 import export_ctranslate2
    from transformer.export.hf import export_hf

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    config, decoding = source.config, source.decoding
    beam, alpha = int(decoding["beam_size"]), float(decoding["length_penalty"])
    a, b = float(decoding["max_len_a"]), float(decoding["max_len_b"])
    tokenizer = tokenizers.Tokenizer.from_str(source.src_tokenizer_json)
    n = sum(len(batch) for batch in batches)
    prepared = []  # per batch: sentence indices, padded ids (B, S), subword strings, the batch's length limit
    for batch in batches:
        encodings = [tokenizer.encode(text) for _, text in batch]  # <s> ... </s>, as our datamodule
        ids = [torch.tensor(e.ids) for e in encodings]
        src = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=config.pad_id)
        strings = [e.tokens[1:-1] for e in encodings]  # plain subwords: CTranslate2 adds <s> and </s>
        # ours stops each sentence at floor(a * S + b) tokens (EOS included, S counting <s> and </s>);
        # transformers and CTranslate2 take one limit per call: the batch's longest
        limit = min(max(math.floor(a * len(i) + b) for i in ids), config.max_len)
        prepared.append(([i for i, _ in batch], src, strings, limit))
    eos, pad = config.eos_id, config.pad_id

    def collect(rows_per_batch: list[tuple[list[int], list[list[int]]]]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(n)]
        for indices, rows in rows_per_batch:
            for i, row in zip(indices, rows):
                out[i] = [t for t in (row[: row.index(eos)] if eos in row else row) if t != pad]
        return out

    def ours(k: int) -> Callable[..., list[list[int]]]:
        def run(first: int | None = None) -> list[list[int]]:
            results = []
            for indices, src, _, _ in prepared[:first]:
                if k == 1:
                    tokens = greedy_search(source.model, src, max_len_a=a, max_len_b=b)
                else:
                    tokens = beam_search(
                        source.model, src, beam_size=k, length_penalty=alpha, max_len_a=a, max_len_b=b
                    )[0][:, 0]
                results.append((indices, tokens.tolist()))
            return collect(results)

        return run

    export_ctranslate2(source, tmp / "ct2")
    export_ctranslate2(source, tmp / "ct2_int8", quantization="int8")
    export_hf(source, tmp / "hf")
    vocabulary = {token: i for i, token in enumerate(source.vocabulary("tgt"))}
    translators: dict[tuple[str, int], ctranslate2.Translator] = {}

    def ct2(directory: str, compute_type: str, k: int, parallel: int = 1) -> Callable[..., list[list[int]]]:
        """CTranslate2 with `threads` threads in all: one batch at a time on all of them, or `parallel`
        batches at once (its inter_threads) on threads / parallel each."""
        if (directory, parallel) not in translators:
            translators[directory, parallel] = ctranslate2.Translator(
                str(tmp / directory),
                device="cpu",
                compute_type=compute_type,
                inter_threads=parallel,
                intra_threads=max(threads // parallel, 1),
            )
        translator = translators[directory, parallel]

        def run(first: int | None = None) -> list[list[int]]:
            pending = [
                (
                    indices,
                    translator.translate_batch(
                        strings,
                        beam_size=k,
                        length_penalty=alpha,
                        max_decoding_length=limit - 1,
                        asynchronous=True,
                    ),
                )
                for indices, _, strings, limit in prepared[:first]
            ]  # queued: with inter_threads > 1, that many batches run at once
            return collect(
                [
                    (indices, [[vocabulary[t] for t in r.result().hypotheses[0]] for r in out])
                    for indices, out in pending
                ]
            )

        return run

    marian = AutoModelForSeq2SeqLM.from_pretrained(tmp / "hf").eval()

    def hf(k: int) -> Callable[..., list[list[int]]]:
        def run(first: int | None = None) -> list[list[int]]:
            results = []
            with torch.no_grad():
                for indices, src, _, limit in prepared[:first]:
                    generated = marian.generate(
                        input_ids=src, attention_mask=src.ne(pad), num_beams=k, length_penalty=alpha,
                        max_new_tokens=limit,
                    )  # fmt: skip
                    results.append((indices, generated[:, 1:].tolist()))  # without the decoder start token
            return collect(results)

        return run

    return {
        f"ours beam{beam}": ours(beam),
        # CTranslate2 as deployed on `threads` cores: that many batches at once, one thread each
        f"ctranslate2 float32 beam{beam}": ct2("ct2", "float32", beam, parallel=threads),
        f"ctranslate2 int8 beam{beam}": ct2("ct2_int8", "int8", beam, parallel=threads),
        # one batch at a time on every thread (intra_threads=threads)
        f"ctranslate2 int8 beam{beam}, 1x{threads} thr": ct2("ct2_int8", "int8", beam),
        f"transformers generate beam{beam}": hf(beam),
        "ours greedy": ours(1),
        "ctranslate2 float32 greedy": ct2("ct2", "float32", 1, parallel=threads),
        "transformers generate greedy": hf(1),
    }


def _sequence_log_probs(
    model: Seq2SeqTransformer, src_ids: list[Tensor], hypotheses: list[list[int]]
) -> list[float]:
    """Our model's summed log-probability of each hypothesis (token ids + EOS) given its source."""
    config = model.config
    totals = []
    with torch.no_grad():
        for start in range(0, len(hypotheses), 64):
            src = torch.nn.utils.rnn.pad_sequence(src_ids[start : start + 64], True, config.pad_id)
            tgt = [torch.tensor([config.bos_id, *h, config.eos_id]) for h in hypotheses[start : start + 64]]
            tgt = torch.nn.utils.rnn.pad_sequence(tgt, batch_first=True, padding_value=config.pad_id)
            log_probs = model(src, tgt[:, :-1]).float().log_softmax(-1)  # (B, T, V)
            picked = log_probs.gather(-1, tgt[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T)
            totals += picked.masked_fill(tgt[:, 1:].eq(config.pad_id), 0.0).sum(1).tolist()
    return totals


def _explain_differences(
    model: Seq2SeqTransformer, src_ids: list[Tensor], ours: list[list[int]], theirs: list[list[int]],
    alpha: float, counts_eos: bool,
) -> dict[str, int]:  # fmt: skip
    """Sort the sentences where `theirs` (a beam search scoring length ** alpha) differs from `ours`
    (GNMT's ((5 + length) / 6) ** alpha), both scored by our float32 model: "length penalty" = each is at
    least as good as the other under its own formula; "their search" / "our search" = that search ended
    with a hypothesis that the other found and that its own formula ranks higher (beam search is
    approximate, and the three stop differently)."""
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    if not differ:
        return {"differ": 0}
    picked = [src_ids[i] for i in differ]
    s_ours = _sequence_log_probs(model, picked, [ours[i] for i in differ])
    s_theirs = _sequence_log_probs(model, picked, [theirs[i] for i in differ])
    result = {"differ": len(differ), "length penalty": 0, "their search": 0, "our search": 0}
    for k, i in enumerate(differ):
        length_ours, length_theirs = len(ours[i]) + 1, len(theirs[i]) + 1  # EOS counted
        gnmt_ours = s_ours[k] / ((5 + length_ours) / 6) ** alpha
        gnmt_theirs = s_theirs[k] / ((5 + length_theirs) / 6) ** alpha
        shift = 0 if counts_eos else 1
        len_ours = s_ours[k] / max(length_ours - shift, 1) ** alpha
        len_theirs = s_theirs[k] / max(length_theirs - shift, 1) ** alpha
        if gnmt_theirs > gnmt_ours:
            result["our search"] += 1
        elif len_ours > len_theirs:
            result["their search"] += 1
        else:
            result["length penalty"] += 1
    return result


def deploy_benchmark(args: argparse.Namespace) -> None:
    """--export-ckpt: ours vs CTranslate2 float32 / int8 vs transformers on a real split (see the top)."""
    import tempfile

    from data.sources import load_multi30k
    from data.tokenization import BPETokenizer
    from transformer.evaluation.scoring import corpus_scores
    from transformer.export.source import load_source

    source = load_source(args.export_ckpt)
    data = source.run_config.get("data") or {}
    split = load_multi30k(args.data_dir, [args.split], data.get("src_lang", "de"), data.get("tgt_lang", "en"))
    texts, references = split[args.split]["src"][:], split[args.split]["tgt"][:]
    if args.quick:
        texts, references, args.repeats = texts[:16], references[:16], 1
    threads = torch.get_num_threads()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i].split()))  # similar lengths batched together
    step = args.sentences_per_batch
    batches = [[(i, texts[i]) for i in order[k : k + step]] for k in range(0, len(order), step)]
    tgt_tokenizer = BPETokenizer.from_json(source.tgt_tokenizer_json)
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
        methods = _deploy_methods(source, batches, Path(tmp), threads)
        for method in methods.values():
            method(first=1)  # warm-up: first-call allocations, lazy initialization
        times, outputs = interleaved(methods, args.repeats)
    beam_reference = next(iter(methods))  # ours with the checkpoint's beam; greedy rows: ours greedy
    tokenizer = BPETokenizer.from_json(source.src_tokenizer_json)
    src_ids = [torch.tensor(ids) for ids in tokenizer.encode_batch(texts)]
    alpha = float(source.decoding["length_penalty"])
    rows = {}
    print("x ours, = ours: against ours with the same search (beam or greedy)")
    print(f"{'method':32} {'sent/s':>8} {'x ours':>7} {'BLEU':>6} {'= ours':>7}")
    for name, seconds in times.items():
        reference = "ours greedy" if name.endswith("greedy") else beam_reference  # the same search
        sent_s = len(texts) / statistics.median(seconds)
        hypotheses = [tgt_tokenizer.decode(ids) for ids in outputs[name]]
        same = sum(a == b for a, b in zip(outputs[name], outputs[reference])) / len(texts)
        rows[name] = {
            "sent_s": round(sent_s, 2),
            "speedup": round(paired_ratio(times, name, reference), 3),
            "bleu": round(corpus_scores(hypotheses, references)["bleu"], 2),
            "same_as_ours": round(same, 4),
        }
        float32_export = name.startswith(("ctranslate2 float32", "transformers"))
        if float32_export and reference == beam_reference:  # int8: quantization changes scores
            rows[name]["differences"] = _explain_differences(
                source.model, src_ids, outputs[reference], outputs[name], alpha, counts_eos=name[0] == "t"
            )
        row = rows[name]
        print(f"{name:32} {sent_s:8.2f} {row['speedup']:7.2f} {row['bleu']:6.2f} {100 * same:6.1f}%")
    for name, row in rows.items():
        if "differences" in row:
            print(f"  {name} vs ours: " + ", ".join(f"{k} {v}" for k, v in row["differences"].items()))
    print(json.dumps({
        "benchmark": "bench_decode_export", "checkpoint": str(args.export_ckpt), "split": args.split,
        "sentences": len(texts), "threads": threads, "torch": torch.__version__, "load_start": load[0],
        "load_end": os.getloadavg()[0], "decoding": dict(source.decoding), "methods": rows,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
