"""A student against its teacher, as deployed: both translation checkpoints decode the same split in the
same batches with the same beam, exported to CTranslate2 int8 and with ours (float32, eager).

The batches are the split's sentences sorted by length (words of the source) and cut into groups of
`--sentences-per-batch`, identical for both models; each model tokenizes them with its own tokenizer
(a student may have its own vocabulary). Both decode with the teacher's test beam size and length
penalty, each within its own length limit (`max_len_a * S + max_len_b`). CTranslate2 runs as
`bench_decode.py --export-ckpt` deploys it: as many batches at once as threads, one thread each. The four
methods are interleaved round by round; the table gives sentences/s (median of rounds), the student's
speed relative to the teacher with the same method (median of paired rounds), BLEU (sacreBLEU, as
evaluate.py scores), parameters and the size of the int8 model on disk.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.decode.bench_student TEACHER.ckpt STUDENT.ckpt \
        --data-dir $MULTI30K_DIR [--split test_2016_flickr] [--repeats 3] [--threads 2]
    python -m benchmarks.decode.bench_student --smoke --data-dir $MULTI30K_DIR   # tiny random checkpoints

`--quick`: 16 sentences, one round. `--smoke`: the same, with tiny random checkpoints made in a temporary
directory when none are given (`benchmarks.common.checkpoints`).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: no spinning under load

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common.timing import interleaved, paired_ratio
from benchmarks.decode.deploy import (
    ct2_runner,
    ct2_translator,
    length_batches,
    load_split,
    ours_runner,
    prepare,
)

ROLES = ("teacher", "student")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("teacher", nargs="?", help="the reference translation checkpoint (e.g. a recipe run)")
    parser.add_argument("student", nargs="?", help="the checkpoint compared with it")
    parser.add_argument("--data-dir", default=os.environ.get("MULTI30K_DIR"), help="Multi30k data/task1/raw")
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--sentences-per-batch", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="16 sentences, 1 round: checks that it works")
    parser.add_argument(
        "--smoke", action="store_true", help="--quick, on tiny random checkpoints if none given"
    )
    args = parser.parse_args(argv)
    if args.data_dir is None:
        parser.error("--data-dir: no Multi30k directory given and $MULTI30K_DIR is not set")
    if args.smoke:
        args.quick = True
    if (args.teacher is None or args.student is None) and not args.smoke:
        parser.error("give the TEACHER and STUDENT checkpoints (or --smoke)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.teacher is None or args.student is None:
            from benchmarks.common.checkpoints import smoke_checkpoint

            args.teacher = smoke_checkpoint(Path(tmp) / "teacher.ckpt", args.data_dir, seed=0, d_model=32)
            args.student = smoke_checkpoint(Path(tmp) / "student.ckpt", args.data_dir, seed=1, d_model=16)
        compare(parser, args)


def compare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Time and score the teacher and the student (see the top); print the table and one JSON line."""
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    from data.tokenization import BPETokenizer
    from transformer.evaluation.scoring import corpus_scores
    from transformer.interop.ctranslate2 import export_ctranslate2
    from transformer.interop.source import load_source

    teacher = load_source(args.teacher)
    beam, alpha = int(teacher.decoding["beam_size"]), float(teacher.decoding["length_penalty"])
    student = load_source(args.student)
    student = dataclasses.replace(
        student, decoding={**student.decoding, "beam_size": beam, "length_penalty": alpha}
    )
    sources = dict(zip(ROLES, (teacher, student)))
    pairs = {
        role: tuple((s.run_config.get("data") or {}).get(k) for k in ("src_lang", "tgt_lang"))
        for role, s in sources.items()
    }
    if pairs["student"] != pairs["teacher"]:
        parser.error(f"the student translates {pairs['student']}, the teacher {pairs['teacher']}")
    texts, references = load_split(args.data_dir, args.split, teacher.run_config, args.quick)
    repeats = 1 if args.quick else args.repeats
    step = args.sentences_per_batch
    batches = length_batches(texts, step)
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, cpu, {threads} threads (CTranslate2 int8: inter_threads={threads}, "
        f"intra_threads=1), load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; {len(texts)} sentences of "
        f"{args.split} in batches of {step}, beam {beam}, alpha {alpha}; sentences/s (median of {repeats})"
    )
    methods, sizes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for role, source in sources.items():
            split = prepare(source, batches)
            export_ctranslate2(source, Path(tmp) / role, quantization="int8")
            vocabulary = {token: i for i, token in enumerate(source.vocabulary("tgt"))}
            translator = ct2_translator(Path(tmp) / role, "int8", threads, parallel=threads)
            methods[f"{role} ours beam{beam}"] = ours_runner(source, split, beam)
            int8 = ct2_runner(translator, split, beam, alpha, vocabulary)
            methods[f"{role} ctranslate2 int8 beam{beam}"] = int8
            sizes[role] = {
                "parameters": sum(p.numel() for p in source.model.parameters()),
                "int8_bytes": (Path(tmp) / role / "model.bin").stat().st_size,
            }
        for method in methods.values():
            method(first=1)  # warm-up: first-call allocations, lazy initialization
        times, outputs = interleaved(methods, repeats)

    rows: dict[str, dict] = {}
    print(f"{'method':34} {'sent/s':>8} {'x teacher':>9} {'BLEU':>6}")
    for name, seconds in times.items():
        role = name.split()[0]
        tokenizer = BPETokenizer.from_json(sources[role].tgt_tokenizer_json)
        hypotheses = [tokenizer.decode(ids) for ids in outputs[name]]
        reference = name.replace("student", "teacher")
        rows[name] = {
            "sent_s": round(len(texts) / statistics.median(seconds), 2),
            "x_teacher": round(paired_ratio(times, name, reference), 3),
            "bleu": round(corpus_scores(hypotheses, references)["bleu"], 2),
        }
        row = rows[name]
        print(f"{name:34} {row['sent_s']:8.2f} {row['x_teacher']:9.2f} {row['bleu']:6.2f}")
    for role, size in sizes.items():
        megabytes = size["int8_bytes"] / 2**20
        print(f"{role}: {size['parameters'] / 1e6:.1f}M parameters, int8 model {megabytes:.1f} MiB")
    print(json.dumps({
        "benchmark": "bench_student", "teacher": str(args.teacher), "student": str(args.student),
        "split": args.split, "sentences": len(texts), "threads": threads, "beam": beam, "alpha": alpha,
        "torch": torch.__version__, "load_start": load[0], "load_end": os.getloadavg()[0],
        "sizes": sizes, "methods": rows,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
