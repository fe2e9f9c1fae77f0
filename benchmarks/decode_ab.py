"""Decoding A/B in CPU time: this checkout's greedy and beam-4 search vs our code at a git revision, the
same weights (d256 3+3, vocab 10k, 64 sentences x 40 tokens), one thread, rounds interleaved. CPU time
(`time.process_time`) instead of wall time, so that other jobs on a shared machine disturb it less.
Both must give the same tokens. `--features` instead times what sampling (top-k 10) costs over greedy
search and a 2-model ensemble over one model (beam 4), in the same way. `--kv-cache` times the
`decode.kv_cache` modes against the default ("dynamic": the growing cache) in one run, greedy and beam 4:
"static" (preallocated, fixed shapes, eager) and "compiled" (the static step through torch.compile's
default inductor backend on the CPU; compiled before the timed rounds, the compile time printed).

`--host` times the host's share of eager decoding, what bounds it on a GPU: the WMT-base depth (6 + 6
layers, 8 heads) at a width of 64 and 4 sentences a batch, where a step's arithmetic is negligible and its
time is the Python and dispatcher work of its operators; ours against transformers `generate`
(MarianMTModel of the same shape, each at 32 tokens, as bench_gpu.py decodes) and, with a REVISION,
against our code there too. `--cuda-path` runs our attention's CUDA code on the CPU (the SDPA backends
without cuDNN's, `kernels._WITHOUT_CUDNN_DEVICES`, in both checkouts): the host work a GPU's step pays.

    python benchmarks/decode_ab.py REVISION [ROUNDS]
    python benchmarks/decode_ab.py --features [ROUNDS]
    python benchmarks/decode_ab.py --kv-cache [ROUNDS]
    python benchmarks/decode_ab.py --host [REVISION] [ROUNDS] [--cuda-path]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from references import load_revision

from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer
from transformer.search.decoding import DecodingSettings, beam_search, greedy_search, sample, search
from transformer.search.ensemble import Ensemble

SHAPE = {"d_model": 256, "n_heads": 4, "n_encoder_layers": 3, "n_decoder_layers": 3, "d_ff": 1024}
# --host: the WMT-base depth, so many operators a step; so narrow that they cost their dispatch only
HOST_SHAPE = {"d_model": 64, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6, "d_ff": 64}
HOST_LENGTH = 32  # target tokens per sentence (EOS forced there, as bench_gpu.py decodes)
HOST_BATCH = 4  # sentences a batch, 2 batches: few enough that each kernel costs about its dispatch


def _cpu_seconds(run: Callable[[], object]) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def _paired(
    name: str, first: Callable[[], object], second: Callable[[], object], rounds: int
) -> tuple[float, float, list[float]]:
    """Median CPU seconds of `first` and `second` over interleaved rounds, and second / first per round."""
    times: dict[str, list[float]] = {"first": [], "second": []}
    for r in range(rounds):
        order = (
            [("first", first), ("second", second)] if r % 2 == 0 else [("second", second), ("first", first)]
        )
        for key, run in order:
            times[key].append(_cpu_seconds(run))
    ratios = [b / a for a, b in zip(times["first"], times["second"])]
    return statistics.median(times["first"]), statistics.median(times["second"]), ratios


def _features(rounds: int) -> None:
    values = {"src_vocab_size": 10_000, "dropout": 0.0, "max_len": 256, **SHAPE}
    torch.manual_seed(0)
    model = Seq2SeqTransformer(TransformerConfig(**values)).eval()  # type: ignore[arg-type]
    torch.manual_seed(1)
    ensemble = Ensemble([model, Seq2SeqTransformer(TransformerConfig(**values))])  # type: ignore[arg-type]
    src = torch.randint(4, 10_000, (64, 24), generator=torch.Generator().manual_seed(1))
    src[:, 0], src[:, -1] = 1, 2
    limit = {"max_len_a": 0, "max_len_b": 40}
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
        a, b, ratios = _paired(name, first, second, rounds)
        print(
            f"{name:34} {b:.3f} s / {a:.3f} s CPU: median ratio {statistics.median(ratios):.3f}, "
            f"rounds {[round(x, 3) for x in ratios]}"
        )


def _kv_cache(rounds: int) -> None:
    values = {"src_vocab_size": 10_000, "dropout": 0.0, "max_len": 256, **SHAPE}
    torch.manual_seed(0)
    model = Seq2SeqTransformer(TransformerConfig(**values)).eval()  # type: ignore[arg-type]
    src = torch.randint(4, 10_000, (64, 24), generator=torch.Generator().manual_seed(1))
    src[:, 0], src[:, -1] = 1, 2

    def run(beam_size: int, kv_cache: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        settings = DecodingSettings(beam_size=beam_size, max_len_a=0, max_len_b=40, kv_cache=kv_cache)
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
            base, other, ratios = _paired(
                kv_cache, run(beam_size, "dynamic"), run(beam_size, kv_cache), rounds
            )
            print(
                f"beam {beam_size} {kv_cache:8} {other:.3f} s / dynamic {base:.3f} s CPU: median ratio "
                f"{statistics.median(ratios):.3f} (> 1: slower than dynamic), "
                f"rounds {[round(x, 3) for x in ratios]}"
            )
        print(f"beam {beam_size} first compiled search (compiling included): {compile_s:.1f} s wall")


def _generate(marian: Any, batches: list[torch.Tensor], beams: int) -> Callable[[], list[torch.Tensor]]:
    from bench_decode import marian_generate

    return lambda: [marian_generate(marian, src, HOST_LENGTH, beams) for src in batches]


def _host(revision: str | None, rounds: int, cuda_path: bool) -> None:
    from gpu_decode import decode_models, source_batches

    import transformer.search.decoding as decoding
    from transformer import kernels

    values = {"src_vocab_size": 1_000, "dropout": 0.0, "max_len": 256, **HOST_SHAPE}
    ours, marian = decode_models(TransformerConfig(**values), torch.device("cpu"), torch.float32)
    batches = source_batches(2, HOST_BATCH, values["src_vocab_size"])
    steps = len(batches) * HOST_LENGTH
    old: dict[str, Any] = {}
    if revision is not None:
        old = load_revision(revision)
        old_model = old["model"].Seq2SeqTransformer(old["config"].TransformerConfig(**values)).eval()
        old_model.load_state_dict(ours.state_dict())
    if cuda_path:
        for module in (kernels, old.get("kernels")):
            if module is not None:
                module._WITHOUT_CUDNN_DEVICES = frozenset({"cpu"})

    def runner(model: Any, module: Any, beams: int) -> Callable[[], list[torch.Tensor]]:
        limit = {"max_len_a": 0, "max_len_b": HOST_LENGTH}
        if beams == 1:
            return lambda: [module.greedy_search(model, src, **limit) for src in batches]
        return lambda: [module.beam_search(model, src, beam_size=beams, **limit)[0] for src in batches]

    for name, beams in (("greedy", 1), ("beam4", 4)):
        run_ours = runner(ours, decoding, beams)
        competitors = {"transformers generate": _generate(marian, batches, beams)}
        if old:
            run_old = runner(old_model, old["decoding"], beams)
            if not all(torch.equal(a, b) for a, b in zip(run_ours(), run_old())):
                raise RuntimeError(f"{name}: this checkout and {revision} decode different tokens")
            competitors[f"ours at {revision}"] = run_old
        for label, other in competitors.items():
            now, then, ratios = _paired(name, run_ours, other, rounds)
            print(
                f"host {name:6} ours {now / steps * 1e3:.2f} ms/step, {label} {then / steps * 1e3:.2f} "
                f"ms/step CPU; {label} / ours (> 1: ours faster): median {statistics.median(ratios):.3f}, "
                f"rounds {[round(x, 3) for x in ratios]}"
            )


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1] == "--host":
        rest = [arg for arg in sys.argv[2:] if arg != "--cuda-path"]
        revision = rest.pop(0) if rest and not rest[0].isdigit() else None
        _host(revision, int(rest[0]) if rest else 5, "--cuda-path" in sys.argv)
        return
    if sys.argv[1] in ("--features", "--kv-cache"):
        mode = _features if sys.argv[1] == "--features" else _kv_cache
        mode(int(sys.argv[2]) if len(sys.argv) > 2 else 5)
        return
    revision, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
    old = load_revision(revision)
    values = {"src_vocab_size": 10_000, "dropout": 0.0, "max_len": 256, **SHAPE}
    torch.manual_seed(0)
    new_model = Seq2SeqTransformer(TransformerConfig(**values)).eval()  # type: ignore[arg-type]
    torch.manual_seed(0)
    old_model = old["model"].Seq2SeqTransformer(old["config"].TransformerConfig(**values)).eval()
    src = torch.randint(4, 10_000, (64, 24), generator=torch.Generator().manual_seed(1))
    src[:, 0], src[:, -1] = 1, 2
    limit = {"max_len_a": 0, "max_len_b": 40}
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
        now, then, ratios = _paired(name, new, before, rounds)
        print(
            f"{name:7} this checkout {now:.3f} s CPU, {revision} {then:.3f} s; {revision} / this (> 1: this "
            f"faster): median {statistics.median(ratios):.3f}, rounds {[round(x, 3) for x in ratios]}"
        )


if __name__ == "__main__":
    main()
