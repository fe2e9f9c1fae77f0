"""bench_gpu.py's decoding part: ours vs transformers `generate` (and CTranslate2) on the same random-weight
WMT-base models and the same length-sorted source batches, every sentence exactly `length` target tokens.

The work is fixed as in bench_decode.py: ours stops at `max_len_a=0, max_len_b=length` (EOS forced there),
`generate` with `min_new_tokens = max_new_tokens = length` and `forced_eos_token_id`, CTranslate2 with
`min_decoding_length = max_decoding_length = length`: `length` decoder steps each (random weights almost
never choose EOS earlier; the mean output lengths are printed to show it). Sources are [BOS .. EOS] with
WMT-like lengths (gpu_train.wmt_lengths), sorted by length and cut into batches, as evaluation batches them.
CTranslate2 gets the same weights through the project's exporter (`to_ctranslate2_spec`) and a word-level
stand-in vocabulary (token i = "t<i>").
"""

from __future__ import annotations

import functools
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.common.references import (
    BOS,
    EOS,
    LENGTH_PENALTY,
    PAD,
    MarianReference,
    marian_generate,
    mean_length,
)
from benchmarks.common.shapes import wmt_lengths
from benchmarks.common.timing import interleaved, paired_ratio, timed
from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer
from transformer.search import static_cache
from transformer.search.compiled import compile_step
from transformer.search.decoding import DecodingSettings, search

MODES = {"beam4": 4, "greedy": 1}
# --decode-methods' names for decode_methods' keys
METHOD_KEYS = {
    "ours": "ours", "generate": "transformers generate", "compiled": "ours compiled step",
    "cudagraphs": "ours cudagraphs step", "graphed": "ours graphed step", "ctranslate2": "ctranslate2",
}  # fmt: skip


def source_batches(n_batches: int, batch_size: int, vocab: int, seed: int = 1) -> list[Tensor]:
    """`n_batches` batches of [BOS, random ids, EOS] sources, consecutive in length order."""
    src_len, _ = wmt_lengths(n_batches * batch_size, seed, max_len=200)
    src_len.sort()
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for k in range(n_batches):
        lengths = torch.from_numpy(src_len[k * batch_size : (k + 1) * batch_size])
        ids = torch.randint(4, vocab, (batch_size, int(lengths.max()) + 2), generator=generator)
        position = torch.arange(ids.size(1))
        ids[:, 0] = BOS
        ids[torch.arange(batch_size), lengths + 1] = EOS
        batches.append(ids.masked_fill(position > lengths[:, None] + 1, PAD))
    return batches


def ctranslate2_translator(model: Seq2SeqTransformer, device: torch.device, tmp: Path) -> Any:
    """Our model's weights as a CTranslate2 Translator on `device` (bfloat16 on CUDA, float32 on the CPU)."""
    import ctranslate2
    import tokenizers

    from transformer.interop.ctranslate2 import keeping_torch_threads, to_ctranslate2_spec
    from transformer.interop.source import ExportSource

    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>"])}
    vocab.update({f"t{i}": i for i in range(4, model.config.tgt_vocab_size)})
    joint = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")).to_str()
    cpu_model = Seq2SeqTransformer(model.config)
    cpu_model.load_state_dict({k: v.float().cpu() for k, v in model.state_dict().items()})
    source = ExportSource(Path("random"), cpu_model.eval(), {"joint": joint}, {}, {}, {})
    spec = to_ctranslate2_spec(source)
    spec.optimize(quantization="bfloat16" if device.type == "cuda" else None)
    (tmp / "ct2").mkdir()
    spec.save(str(tmp / "ct2"))
    compute_type = "bfloat16" if device.type == "cuda" else "float32"
    with keeping_torch_threads():
        return ctranslate2.Translator(str(tmp / "ct2"), device=device.type, compute_type=compute_type)


def ctranslate2_available(device: torch.device) -> str | None:
    """Why CTranslate2 cannot run on `device` here, or None."""
    try:
        import ctranslate2
    except ImportError:
        return "ctranslate2 not installed"
    if device.type == "cuda" and ctranslate2.get_cuda_device_count() == 0:
        return f"ctranslate2 {ctranslate2.__version__} is a CPU build"
    return None


@contextmanager
def step_backend(backend: str) -> Iterator[None]:
    """`decode.kv_cache=compiled` with its step compiled by `backend` instead of Inductor (measurements, not
    settings: `static_cache.compile_step` is the one place that picks the compiled step)."""
    default = static_cache.compile_step
    static_cache.compile_step = functools.partial(compile_step, backend=backend)
    try:
        yield
    finally:
        static_cache.compile_step = default


def decode_methods(
    ours: Seq2SeqTransformer,
    marian: MarianReference,
    ct2: Any,
    batches: list[Tensor],
    beams: int,
    length: int,
) -> dict[str, Callable[[], list[Tensor]]]:
    """Each decoder over every batch -> its (B, L) outputs (without BOS)."""

    def settings(kv_cache: str) -> DecodingSettings:
        return DecodingSettings(
            beam_size=beams, length_penalty=LENGTH_PENALTY, max_len_a=0, max_len_b=length, kv_cache=kv_cache
        )

    def run(kv_cache: str) -> list[Tensor]:
        chosen = settings(kv_cache)
        return [search(ours, src, chosen)[0][:, 0] for src in batches]

    def run_ours() -> list[Tensor]:  # eager: the growing cache, whatever `auto` means on the device
        return run("dynamic")

    methods = {
        "ours": run_ours,
        "transformers generate": lambda: [marian_generate(marian, src, length, beams) for src in batches],
    }
    if batches and batches[0].is_cuda:  # the static cache, its step replayed as CUDA graphs

        def run_compiled() -> list[Tensor]:  # decode.kv_cache=compiled
            return run("compiled")

        def run_cudagraphs() -> list[Tensor]:
            # the same, its step recorded without Inductor's code generation
            with step_backend("cudagraphs"):
                return run_compiled()

        def run_graphed() -> list[Tensor]:  # decode.kv_cache=graphed (auto on CUDA): no compiler
            return run("graphed")

        methods["ours compiled step"] = run_compiled
        methods["ours cudagraphs step"] = run_cudagraphs
        methods["ours graphed step"] = run_graphed
    if ct2 is not None:
        strings = [[[f"t{i}" for i in row if i > 3] for row in src.tolist()] for src in batches]

        def run_ct2() -> list[Tensor]:
            outputs = []
            for batch in strings:
                results = ct2.translate_batch(
                    batch, beam_size=beams, length_penalty=LENGTH_PENALTY,
                    min_decoding_length=length, max_decoding_length=length,
                )  # fmt: skip
                outputs.append(torch.tensor([[int(t[1:]) for t in r.hypotheses[0]] for r in results]))
            return outputs

        methods["ctranslate2"] = run_ct2
    return methods


def decode_models(config: TransformerConfig, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """Ours and MarianMTModel at `config`, random weights, eval mode, cast to `dtype` on `device`."""
    torch.manual_seed(0)
    ours = Seq2SeqTransformer(config).eval().to(device, dtype)
    marian = MarianReference(config).eval().to(device, dtype)
    return ours, marian


class DecodingBench:
    """The decoding cases of bench_gpu.py, one at a time (each in its own time box there): ours and
    MarianMTModel built once, CTranslate2 when a build for the device is importable. `case(size, mode)` ->
    every method's sentences/s, tokens/s, mean length and paired ratio vs ours; a method that fails is
    reported as {"error": ...}."""

    def __init__(self, config: TransformerConfig, args: Any, device: torch.device) -> None:
        self.config, self.args, self.device = config, args, device
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.ours, self.marian = decode_models(config, device, dtype)
        self.tmp = tempfile.TemporaryDirectory()
        self.ct2 = None
        self.ctranslate2 = ctranslate2_available(device) or "ran"
        if self.ctranslate2 == "ran":
            try:
                self.ct2 = ctranslate2_translator(self.ours, device, Path(self.tmp.name))
            except Exception as error:  # reported, the others still run
                self.ctranslate2 = f"failed: {type(error).__name__}: {error}"

    def case(self, size: int, mode: str) -> dict[str, Any]:
        vocab = self.config.src_vocab_size
        batches = [b.to(self.device) for b in source_batches(self.args.decode_batches, size, vocab)]
        return _time_case(self.ours, self.marian, self.ct2, batches, MODES[mode], self.args, self.device)

    def close(self) -> None:
        self.tmp.cleanup()


def _time_case(
    ours: Any, marian: Any, ct2: Any, batches: list[Tensor], beams: int, args: Any, device: torch.device
) -> dict[str, Any]:
    methods = decode_methods(ours, marian, ct2, batches, beams, args.decode_length)
    wanted = {METHOD_KEYS[key] for key in args.decode_methods}
    methods = {name: method for name, method in methods.items() if name in wanted}
    sentences = sum(b.size(0) for b in batches)
    rows: dict[str, Any] = {}
    working, first = {}, {}
    for name, method in methods.items():
        try:
            # warm-up: first-call allocations, kernel selection; compiling and CUDA graphs, which record on
            # the second call: a method that fails there is reported too, not raised in the timed rounds
            first[name], _ = timed(method, device)
            method()
            working[name] = method
        except TimeoutError:  # bench_gpu's time box of the whole case: end it
            raise
        except Exception as error:
            rows[name] = {"error": f"{type(error).__name__}: {str(error).strip()[:200]}"}
    times, outputs = interleaved(working, args.decode_repeats, device)
    for name, seconds in times.items():
        best = statistics.median(seconds)
        lengths = [mean_length(out.cpu()) * out.size(0) for out in outputs[name]]
        tokens = sum(lengths) if name != "ctranslate2" else sum(out.numel() for out in outputs[name])
        rows[name] = {"sent_s": sentences / best, "tok_s": tokens / best, "mean_length": tokens / sentences}
        rows[name]["first_s"] = first[name]  # the warm-up round: what a one-off job pays on top
        if name != "ours" and "ours" in times:
            rows[name]["ours_speedup"] = paired_ratio(times, "ours", name)
            if name.startswith("ours "):  # the same weights (generate's model has its own)
                rows[name]["same_as_ours"] = same_sentences(outputs["ours"], outputs[name])
    return rows


def same_sentences(reference: list[Tensor], outputs: list[Tensor]) -> float | None:
    """The fraction of sentences whose tokens equal the reference's (None: other shapes)."""
    if [r.shape for r in reference] != [o.shape for o in outputs]:
        return None
    same = sum(int((r.cpu() == o.cpu()).all(dim=1).sum()) for r, o in zip(reference, outputs))
    return same / sum(r.size(0) for r in reference)
