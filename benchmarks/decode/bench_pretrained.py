"""Decoding speed of an OPUS-MT-shaped model: ours vs transformers' `generate` vs CTranslate2, same weights.

A MarianMTModel shaped like Helsinki-NLP/opus-mt-de-en (d_model 512, 6+6 layers, 8 heads, d_ff 2048, SiLU,
58,101 tokens, `final_logits_bias`, shared embeddings, the decoder starting from <pad>) with random weights
(transformers' initialisation, seeded: speed does not depend on the values) is saved as `save_pretrained`
writes it, imported with `aiayn-import`'s code (`transformer.interop.import_hf.import_hf`) and exported to
CTranslate2 float32 with `aiayn-export`'s (`transformer.interop.ctranslate2`): the three decode the same
weights. `generate` runs on the saved directory, with its generation config (<pad> banned, EOS forced at
the last step), as OPUS-MT ships it; CTranslate2 bans <pad> with `suppress_sequences`, as docs/pretrained.md
says to.

Sources: the model has no SentencePiece model of its own, so the source ids are random (seeded; no special
token), of realistic lengths: as many as the pieces of the first `--sentences` Multi30k test_2016_flickr
German sentences under a SentencePiece unigram model trained on Multi30k's German training text (8k
pieces), plus </s>; batches of `--batch-size` in file order, the same id batches for all three.

The work is fixed: random weights decode to the length limit or stop at once, so every sentence gets
exactly `--length` tokens from each system, each running that many decoder steps: ours with
`min_len = length - 1` and `max_len_b = length` (EOS banned, then forced at the last token), `generate`
with `min_new_tokens = max_new_tokens = length` (EOS forced at the last), CTranslate2 with
`min_decoding_length = max_decoding_length = length` (it has no forced EOS: `length` tokens, none EOS).
The token count of every sentence is checked (24 tokens: about 1.5x the sources' mean length). Greedy
search and beam 4 (length penalty 1.0; every hypothesis has the same length), one batch at a time on the
same intra-op threads (torch's; CTranslate2 `intra_threads`, `inter_threads=1`). A warm-up (each method on
the first batch, 4 tokens), then `--repeats` rounds with the methods interleaved (the order rotates), so
that other jobs on the machine slow all of them alike: the paired ratios are what to read. sentences/s and
tokens/s are medians over rounds; "same" is the share of sentences whose first `length - 1` tokens equal
ours' (CTranslate2's last token is not EOS; its beam search ranks its final hypotheses without the forced
EOS's log-probability that ours and `generate` add, so its beam rows may differ at the end).

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.decode.bench_pretrained --data-dir $MULTI30K_DIR \
        [--repeats 3] [--threads 2] [--length 24] [--results-dir benchmarks/results/decode]

`--smoke`: a tiny shape (d_model 32, 1+1 layers, 1,000 tokens), 8 sentences, 6 tokens, one round.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning under load

import argparse
import datetime
import gzip
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.common.machine import cpu_name
from benchmarks.common.results import RESULTS_DIR, logged_stdout
from benchmarks.common.timing import interleaved, paired_ratio
from benchmarks.decode.deploy import ct2_translator

# OPUS-MT de-en's shape (its config.json); the smoke shape is tiny
SHAPES = {
    "opus-mt": {"d_model": 512, "layers": 6, "heads": 8, "d_ff": 2048, "vocab": 58_101, "spm_vocab": 8000},
    "smoke": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "vocab": 1000, "spm_vocab": 200},
}
EOS, UNK = 0, 1  # OPUS-MT's: </s> = 0, <unk> = 1, <pad> = the last id
SYSTEMS = ("ours", "generate", "ctranslate2")
Runner = Callable[[], list[list[int]]]


def _multi30k(data_dir: Path, name: str, n: int | None = None) -> list[str]:
    with gzip.open(data_dir / name, "rt", encoding="utf-8") as handle:
        lines = [line.strip() for line in handle]
    return lines[:n]


def _sentencepiece(directory: Path, data_dir: Path, vocab_size: int, lines: int | None) -> Any:
    """A unigram SentencePiece model trained on Multi30k's German training text, saved as source.spm and
    target.spm (the import needs a tokenizer pair; only the source lengths are read from it)."""
    import sentencepiece

    text = directory / "train.de.txt"
    text.write_text("\n".join(_multi30k(data_dir, "train.de.gz", lines)) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(directory / "spm"), vocab_size=vocab_size, model_type="unigram",
        character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2,
    )  # fmt: skip
    model = (directory / "spm.model").read_bytes()
    for name in ("source.spm", "target.spm"):
        (directory / name).write_bytes(model)
    return sentencepiece.SentencePieceProcessor(model_file=str(directory / "spm.model"))


def opus_mt_directory(directory: Path, data_dir: Path, shape: dict[str, int], lines: int | None) -> Any:
    """A MarianMTModel directory shaped like opus-mt-de-en (random weights, seeded), with tokenizer files:
    the SentencePiece model's pieces, then filler pieces up to the vocabulary size, <pad> last. Returns the
    SentencePiece processor."""
    import transformers

    directory.mkdir(parents=True)
    processor = _sentencepiece(directory, data_dir, shape["spm_vocab"], lines)
    vocab_size = shape["vocab"]
    pieces = [processor.id_to_piece(i) for i in range(1, processor.get_piece_size())]
    pieces += [f"▁filler{i}" for i in range(vocab_size - 3 - len(pieces))]
    vocab = {
        "</s>": EOS,
        "<unk>": UNK,
        **{piece: i + 2 for i, piece in enumerate(pieces)},
        "<pad>": vocab_size - 1,
    }
    assert len(vocab) == vocab_size
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    settings = {"tokenizer_class": "MarianTokenizer", "separate_vocabs": False, "source_lang": "de",
                "target_lang": "en"}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    pad = vocab_size - 1
    config = transformers.MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=shape["d_model"],
        encoder_layers=shape["layers"], decoder_layers=shape["layers"],
        encoder_attention_heads=shape["heads"], decoder_attention_heads=shape["heads"],
        encoder_ffn_dim=shape["d_ff"], decoder_ffn_dim=shape["d_ff"],
        activation_function="swish", pad_token_id=pad, eos_token_id=EOS, bos_token_id=EOS,
        decoder_start_token_id=pad, forced_eos_token_id=EOS, max_position_embeddings=512,
        scale_embedding=True, share_encoder_decoder_embeddings=True, dropout=0.1,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.MarianMTModel(config).eval()
    model.generation_config = transformers.GenerationConfig(
        num_beams=4, max_length=512, bad_words_ids=[[pad]], decoder_start_token_id=pad, eos_token_id=EOS,
        pad_token_id=pad, forced_eos_token_id=EOS,
    )  # fmt: skip
    model.save_pretrained(directory)
    return processor


def source_batches(
    processor: Any, data_dir: Path, sentences: int, batch_size: int, vocab_size: int
) -> list[Tensor]:
    """(B, S) batches of random ids (seeded), each sentence as long as a Multi30k test sentence's pieces,
    then </s>, padded with <pad>."""
    texts = _multi30k(data_dir, "test_2016_flickr.de.gz", sentences)
    generator = torch.Generator().manual_seed(0)
    rows = [
        torch.cat([torch.randint(2, vocab_size - 1, (len(processor.encode(text)),), generator=generator),
                   torch.tensor([EOS])])
        for text in texts
    ]  # fmt: skip
    pad = vocab_size - 1
    return [
        torch.nn.utils.rnn.pad_sequence(rows[k : k + batch_size], batch_first=True, padding_value=pad)
        for k in range(0, len(rows), batch_size)
    ]


def _rows(tokens: Tensor) -> list[list[int]]:
    """Each row up to and including its first EOS (pads after it dropped)."""
    out = []
    for row in tokens.tolist():
        out.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return out


def runners(
    source: Any, marian: Any, translator: Any, batches: list[Tensor], beam: int, length: int, pad: int
) -> dict[str, Runner]:
    """The three systems decoding `batches` with `beam` (1: greedy), `length` tokens per sentence each."""
    from transformer.search.decoding import beam_search, greedy_search

    model, vocabulary = source.model, source.vocabulary("src")
    limits = {"max_len_a": 0.0, "max_len_b": length, "min_len": length - 1}
    strings = [
        [[vocabulary[i] for i in row if i not in (pad, EOS)] for row in src.tolist()] for src in batches
    ]
    index = {token: i for i, token in enumerate(source.vocabulary("tgt"))}

    def ours() -> list[list[int]]:
        out = []
        for src in batches:
            if beam == 1:
                tokens = greedy_search(model, src, **limits)
            else:
                tokens = beam_search(model, src, beam_size=beam, length_penalty=1.0, **limits)[0][:, 0]
            out += _rows(tokens)
        return out

    def generate() -> list[list[int]]:
        out = []
        with torch.no_grad():
            for src in batches:
                tokens = marian.generate(
                    input_ids=src, attention_mask=src.ne(pad), num_beams=beam, min_new_tokens=length,
                    max_new_tokens=length, length_penalty=1.0, early_stopping=False, do_sample=False,
                )  # fmt: skip
                out += _rows(tokens[:, 1:])  # without the decoder start token
        return out

    def ctranslate2() -> list[list[int]]:
        out = []
        for batch in strings:
            results = translator.translate_batch(
                batch, beam_size=beam, length_penalty=1.0, min_decoding_length=length,
                max_decoding_length=length, suppress_sequences=[["<pad>"]],
            )  # fmt: skip
            out += [[index[t] for t in result.hypotheses[0]] for result in results]
        return out

    return {"ours": ours, "generate": generate, "ctranslate2": ctranslate2}


def measure(args: argparse.Namespace, tmp: Path) -> None:
    """Build, import and export the model, time the three systems (see the top); print the table and one
    JSON line."""
    import ctranslate2
    import transformers
    from transformers import MarianMTModel
    from transformers.utils import logging as hf_logging

    from transformer.interop.ctranslate2 import export_ctranslate2
    from transformer.interop.import_hf import import_hf
    from transformer.interop.source import load_source

    start = time.perf_counter()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    shape = SHAPES[args.shape]
    threads = torch.get_num_threads()
    data_dir = Path(args.data_dir)
    load = os.getloadavg()
    print(
        f"CPU: {cpu_name()}, {_cpu_flags()}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, ctranslate2 {ctranslate2.__version__}; {threads} intra-op threads for "
        f"all three (torch's; CTranslate2 intra_threads={threads}, inter_threads=1); "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}"
    )
    processor = opus_mt_directory(tmp / "marian", data_dir, shape, 500 if args.smoke else None)
    checkpoint = import_hf(tmp / "marian", tmp / "imported")
    source = load_source(checkpoint)
    exported = export_ctranslate2(source, tmp / "ct2")
    translator = ct2_translator(tmp / "ct2", "float32", threads, parallel=1)
    marian = MarianMTModel.from_pretrained(tmp / "marian").eval()
    pad = shape["vocab"] - 1
    batches = source_batches(processor, data_dir, args.sentences, args.batch_size, shape["vocab"])
    lengths = [int(n) for src in batches for n in src.ne(pad).sum(1)]
    parameters = sum(p.numel() for p in source.model.parameters())
    print(
        f"model: d_model {shape['d_model']}, {shape['layers']}+{shape['layers']} layers, "
        f"{shape['heads']} heads, d_ff {shape['d_ff']}, SiLU, vocabulary {shape['vocab']:,}, "
        f"final_logits_bias, random weights; {parameters / 1e6:.1f}M parameters; CTranslate2 float32 "
        f"export checked against ours: max |log p diff| {exported.max_abs_diff:.1e}"
    )
    print(
        f"sources: {len(lengths)} sentences of random ids (seeded), each as long as a Multi30k "
        f"test_2016_flickr German sentence in SentencePiece pieces (unigram, {shape['spm_vocab']} pieces, "
        f"trained on Multi30k train.de) + </s>: mean {statistics.mean(lengths):.1f}, max {max(lengths)}; "
        f"batches of {args.batch_size} in file order; every sentence decodes exactly {args.length} tokens; "
        f"median of {args.repeats} interleaved rounds after a warm-up (the first batch, 4 tokens)"
    )
    print(
        "the machine may be shared: another job slows every method of a round alike, and sent/s moves with it"
        " from round to round and run to run; read the paired ratios (x generate, x ours)"
    )
    methods: dict[str, Runner] = {}
    for beam in args.beams:
        for system, run in runners(source, marian, translator, batches, beam, args.length, pad).items():
            methods[f"{system} {_search(beam)}"] = run
    for beam in args.beams:  # warm-up: first-call allocations, lazy initialization
        for run in runners(source, marian, translator, batches[:1], beam, min(args.length, 4), pad).values():
            run()
    times, outputs = interleaved(methods, args.repeats)
    report(args, times, outputs, len(lengths), shape, threads, load, parameters, time.perf_counter() - start)


def _search(beam: int) -> str:
    return "greedy" if beam == 1 else f"beam{beam}"


def _cpu_flags() -> str:
    """The CPU's AVX-512 and AMX flags (/proc/cpuinfo)."""
    try:
        flags = next(
            line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )  # fmt: skip
    except (OSError, StopIteration):
        return "flags unknown"
    wide = sorted(flag for flag in flags if flag.startswith(("avx512", "amx")))
    return " ".join(wide) if wide else "no AVX-512 / AMX"


def _same(rows: list[list[int]], ours: list[list[int]], length: int) -> int:
    """Sentences whose first `length - 1` tokens equal ours' (the last is ours' forced EOS, CTranslate2's
    not)."""
    return sum(a[: length - 1] == b[: length - 1] for a, b in zip(rows, ours))


def report(
    args: argparse.Namespace, times: dict[str, list[float]], outputs: dict[str, list[list[int]]],
    sentences: int, shape: dict[str, int], threads: int, load: tuple[float, float, float], parameters: int,
    wall_s: float,
) -> None:  # fmt: skip
    """The table (sentences/s, tokens/s, paired ratios, agreement with ours) and the JSON line."""
    for name, rows in outputs.items():
        counts = {len(row) for row in rows}
        if counts != {args.length} or len(rows) != sentences:
            raise RuntimeError(
                f"{name}: {len(rows)} sentences of {sorted(counts)} tokens, not {args.length} each"
            )
    print(f"{'batch ' + str(args.batch_size):14} {'system':12} {'sent/s':>8} {'tok/s':>8} {'x generate':>10} "
          f"{'x ours':>7} {'same':>5}")  # fmt: skip
    result: dict[str, dict[str, float]] = {}
    for beam in args.beams:
        search = _search(beam)
        for system in SYSTEMS:
            name = f"{system} {search}"
            seconds = statistics.median(times[name])
            ours = outputs[f"ours {search}"]
            row = {
                "sent_s": round(sentences / seconds, 2),
                "tok_s": round(sentences * args.length / seconds, 1),
                "x_generate": round(paired_ratio(times, name, f"generate {search}"), 3),
                "x_ours": round(paired_ratio(times, name, f"ours {search}"), 3),
                "same_as_ours": round(_same(outputs[name], ours, args.length) / sentences, 3),
                "rounds_s": [round(t, 2) for t in times[name]],  # each round's seconds, in round order
            }
            result[name] = row
            print(f"{search:14} {system:12} {row['sent_s']:8.2f} {row['tok_s']:8.1f} "
                  f"{row['x_generate']:10.2f} {row['x_ours']:7.2f} {row['same_as_ours']:5.2f}")  # fmt: skip
    print("x generate / x ours: the median over rounds of the other's time / this one's (paired, same round)")
    print(f"the whole run (model, import, export, warm-up, rounds): {wall_s:.0f} s")
    print(json.dumps({
        "benchmark": "bench_pretrained", "shape": args.shape, **{k: shape[k] for k in ("d_model", "layers",
        "heads", "d_ff", "vocab")}, "parameters": parameters, "cpu": cpu_name(), "cpu_flags": _cpu_flags(),
        "threads": threads, "torch": torch.__version__, "batch_size": args.batch_size,
        "sentences": sentences, "length": args.length, "repeats": args.repeats, "load_start": load[0],
        "load_end": os.getloadavg()[0], "wall_s": round(wall_s), "methods": result,
    }))  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR"), help="Multi30k data/task1/raw")
    parser.add_argument("--shape", default="opus-mt", choices=list(SHAPES))
    parser.add_argument("--sentences", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=24, help="tokens every sentence decodes (EOS included)")
    parser.add_argument("--beams", default="4,1", help="beam sizes, comma-separated (1: greedy)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument(
        "--results-dir", default=None, help=f"write the output there too (e.g. {RESULTS_DIR / 'decode'})"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shape, 8 sentences, 6 tokens, one round")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.data_dir is None:
        parser.error("--data-dir: no Multi30k directory given and $MULTI30K_DIR is not set")
    if args.smoke:
        args.shape, args.sentences, args.batch_size, args.length, args.repeats = "smoke", 8, 4, 6, 1
    args.beams = [int(beam) for beam in str(args.beams).split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    with logged_stdout() as log:
        if args.results_dir:
            day = datetime.date.today().isoformat()
            path = Path(args.results_dir) / f"{day}_opus_mt_decode_cpu.txt"
            log.open(path, f"python -m benchmarks.decode.bench_pretrained {' '.join(argv or sys.argv[1:])}")
        with tempfile.TemporaryDirectory() as tmp:
            measure(args, Path(tmp))


if __name__ == "__main__":
    main()
