"""Decoding A/B in CPU time: this checkout's greedy and beam-4 search vs our code at a git revision, the
same weights (d256 3+3, vocab 10k, 64 sentences x 40 tokens), one thread, rounds interleaved. CPU time
(`time.process_time`) instead of wall time, so that other jobs on a shared machine disturb it less.
Both must give the same tokens. `--features` instead times what sampling (top-k 10) costs over greedy
search and a 2-model ensemble over one model (beam 4), in the same way. `--kv-cache` times the
`decode.kv_cache` modes against the default ("dynamic": the growing cache) in one run, greedy and beam 4:
"static" (preallocated, fixed shapes, eager) and "compiled" (the static step through torch.compile's
default inductor backend on the CPU; compiled before the timed rounds, the compile time printed).

`--smoke`: the same code at a tiny shape (d_model 32, 1+1 layers, 4 sentences x 6 tokens), one round.
The host's share of a decoding step (ours against `generate` and a revision, in CPU time) is
`benchmarks.decode.decode_host --cpu-time`.

    python -m benchmarks.decode.decode_ab REVISION [--rounds 5]
    python -m benchmarks.decode.decode_ab --features [--rounds 5]
    python -m benchmarks.decode.decode_ab --kv-cache [--rounds 5]
    python -m benchmarks.decode.decode_ab --smoke (REVISION | --features | --kv-cache)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common.references import load_revision
from benchmarks.common.timing import paired_cpu_seconds
from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer
from transformer.search.decoding import DecodingSettings, beam_search, greedy_search, sample, search
from transformer.search.ensemble import Ensemble

SHAPE = {"d_model": 256, "n_heads": 4, "n_encoder_layers": 3, "n_decoder_layers": 3, "d_ff": 1024}
FULL = {"vocab": 10_000, "sentences": 64, "src_len": 24, "length": 40, **SHAPE}
SMOKE = {"vocab": 100, "sentences": 4, "src_len": 6, "length": 6, "d_model": 32, "n_heads": 2,
         "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64}  # fmt: skip


def _config(case: dict[str, int]) -> dict[str, int | float]:
    """The TransformerConfig keywords of `case`."""
    shape = {k: v for k, v in case.items() if k not in ("vocab", "sentences", "src_len", "length")}
    return {"src_vocab_size": case["vocab"], "dropout": 0.0, "max_len": 256, **shape}


def _source(case: dict[str, int]) -> torch.Tensor:
    """(sentences, src_len) random ids, each sentence <s> ... </s>."""
    shape = (case["sentences"], case["src_len"])
    src = torch.randint(4, case["vocab"], shape, generator=torch.Generator().manual_seed(1))
    src[:, 0], src[:, -1] = 1, 2
    return src


def _features(case: dict[str, int], rounds: int) -> None:
    values = _config(case)
    torch.manual_seed(0)
    model = Seq2SeqTransformer(TransformerConfig(**values)).eval()  # type: ignore[arg-type]
    torch.manual_seed(1)
    ensemble = Ensemble([model, Seq2SeqTransformer(TransformerConfig(**values))])  # type: ignore[arg-type]
    src = _source(case)
    limit = {"max_len_a": 0, "max_len_b": case["length"]}
    draws = torch.Generator().manual_seed(0)
    cases = {
        "sampling top-k 10 / greedy": (
            lambda: greedy_search(model, src, **limit),
            lambda: sample(model, src, top_k=10, generator=draws, **limit),
        ),
        "ensemble of 2 / one model, beam 4": (
            lambda: beam_search(model, src, beam_size=4, **limit),
            lambda: beam_search(ensemble, src, beam_size=4, **limit),
        ),
    }
    for name, (first, second) in cases.items():
        a, b, ratios = paired_cpu_seconds(first, second, rounds)
        print(
            f"{name:34} {b:.3f} s / {a:.3f} s CPU: median ratio {statistics.median(ratios):.3f}, "
            f"rounds {[round(x, 3) for x in ratios]}"
        )


def _kv_cache(case: dict[str, int], rounds: int) -> None:
    torch.manual_seed(0)
    model = Seq2SeqTransformer(TransformerConfig(**_config(case))).eval()  # type: ignore[arg-type]
    src = _source(case)

    def run(beam_size: int, kv_cache: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        settings = DecodingSettings(
            beam_size=beam_size, max_len_a=0, max_len_b=case["length"], kv_cache=kv_cache
        )
        return lambda: search(model, src, settings)

    for beam_size in (1, 4):
        start = time.perf_counter()
        compiled = run(beam_size, "compiled")()  # compiles the step (later rounds reuse it)
        compile_s = time.perf_counter() - start
        dynamic = run(beam_size, "dynamic")()
        for kv_cache in ("static", "compiled"):
            tokens = compiled[0] if kv_cache == "compiled" else run(beam_size, kv_cache)()[0]
            if not torch.equal(tokens, dynamic[0]):
                raise RuntimeError(f"beam {beam_size}: kv_cache={kv_cache} decodes other tokens than dynamic")
            base, other, ratios = paired_cpu_seconds(
                run(beam_size, "dynamic"), run(beam_size, kv_cache), rounds
            )
            print(
                f"beam {beam_size} {kv_cache:8} {other:.3f} s / dynamic {base:.3f} s CPU: median ratio "
                f"{statistics.median(ratios):.3f} (> 1: slower than dynamic), "
                f"rounds {[round(x, 3) for x in ratios]}"
            )
        print(f"beam {beam_size} first compiled search (compiling included): {compile_s:.1f} s wall")


def _revision(case: dict[str, int], revision: str, rounds: int) -> None:
    old = load_revision(revision)
    values = _config(case)
    torch.manual_seed(0)
    new_model = Seq2SeqTransformer(TransformerConfig(**values)).eval()  # type: ignore[arg-type]
    torch.manual_seed(0)
    old_model = old["model"].Seq2SeqTransformer(old["config"].TransformerConfig(**values)).eval()
    src = _source(case)
    limit = {"max_len_a": 0, "max_len_b": case["length"]}
    cases = {
        "greedy": (
            lambda: greedy_search(new_model, src, **limit),
            lambda: old["decoding"].greedy_search(old_model, src, **limit),
        ),
        "beam4": (
            lambda: beam_search(new_model, src, beam_size=4, **limit)[0],
            lambda: old["decoding"].beam_search(old_model, src, beam_size=4, **limit)[0],
        ),
    }
    for name, (new, before) in cases.items():
        if not torch.equal(new(), before()):
            raise RuntimeError(f"{name}: this checkout and {revision} decode different tokens")
        now, then, ratios = paired_cpu_seconds(new, before, rounds)
        print(
            f"{name:7} this checkout {now:.3f} s CPU, {revision} {then:.3f} s; {revision} / this (> 1: this "
            f"faster): median {statistics.median(ratios):.3f}, rounds {[round(x, 3) for x in ratios]}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", nargs="?", help="git revision of our code to compare this checkout with")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--features", action="store_true", help="sampling vs greedy, an ensemble of 2 vs one")
    mode.add_argument(
        "--kv-cache", action="store_true", help="decode.kv_cache static and compiled vs dynamic"
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, one round: checks the code path")
    args = parser.parse_args(argv)
    if (args.revision is not None) + args.features + args.kv_cache != 1:
        parser.error("give a REVISION, or one of --features and --kv-cache")
    torch.set_num_threads(1)
    case, rounds = (SMOKE, 1) if args.smoke else (FULL, args.rounds)
    if args.features:
        _features(case, rounds)
    elif args.kv_cache:
        _kv_cache(case, rounds)
    else:
        _revision(case, args.revision, rounds)


if __name__ == "__main__":
    main()
