"""The deployment runners of `bench_decode.py --export-ckpt`: a trained checkpoint decoded by ours, by its
CTranslate2 exports (float32, int8) and by its transformers (MarianMTModel) export, on the same batches.

Each runner returns the token ids (no BOS / EOS) of every sentence in split order; called with
`first=k`, it decodes only the first k batches (a warm-up). Tokenization happens once, before timing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from transformer.search.decoding import beam_search, greedy_search

if TYPE_CHECKING:
    from transformer.interop.source import ExportSource

Runner = Callable[..., list[list[int]]]


@dataclass
class PreparedBatch:
    indices: list[int]  # the sentences' places in the split
    src: Tensor  # (B, S) padded ids, <s> ... </s> as our datamodule
    strings: list[list[str]]  # plain subwords: CTranslate2 adds <s> and </s>
    limit: int  # the batch's length limit (EOS included)


@dataclass
class PreparedSplit:
    batches: list[PreparedBatch]
    sentences: int
    eos: int
    pad: int

    def collect(self, rows_per_batch: list[tuple[list[int], list[list[int]]]]) -> list[list[int]]:
        """Every sentence's tokens in split order, cut at the first EOS, pads dropped."""
        out: list[list[int]] = [[] for _ in range(self.sentences)]
        for indices, rows in rows_per_batch:
            for i, row in zip(indices, rows):
                out[i] = [
                    t for t in (row[: row.index(self.eos)] if self.eos in row else row) if t != self.pad
                ]
        return out


def load_split(data_dir: str, split: str, run_config: dict, quick: bool) -> tuple[list[str], list[str]]:
    """The Multi30k split's source texts and references in the checkpoint's direction (`run_config`: its
    training config); the first 16 of each with `quick`."""
    from data.sources import load_multi30k

    data = run_config.get("data") or {}
    loaded = load_multi30k(data_dir, [split], data.get("src_lang", "de"), data.get("tgt_lang", "en"))
    texts, references = loaded[split]["src"][:], loaded[split]["tgt"][:]
    return (texts[:16], references[:16]) if quick else (texts, references)


def length_batches(texts: list[str], size: int) -> list[list[tuple[int, str]]]:
    """(index, text) groups of `size`, the texts sorted by their number of words: similar lengths batched
    together, the same batches for every model whatever its tokenizer."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i].split()))
    return [[(i, texts[i]) for i in order[k : k + size]] for k in range(0, len(order), size)]


def prepare(source: ExportSource, batches: list[list[tuple[int, str]]]) -> PreparedSplit:
    """Tokenize `batches` (lists of (index, text) of similar length) once for every runner."""
    import tokenizers

    config, decoding = source.config, source.decoding
    a, b = float(decoding["max_len_a"]), float(decoding["max_len_b"])
    tokenizer = tokenizers.Tokenizer.from_str(source.src_tokenizer_json)
    prepared = []
    for batch in batches:
        encodings = [tokenizer.encode(text) for _, text in batch]  # <s> ... </s>, as our datamodule
        ids = [torch.tensor(e.ids) for e in encodings]
        src = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=config.pad_id)
        strings = [e.tokens[1:-1] for e in encodings]
        # ours stops each sentence at floor(a * S + b) tokens (EOS included, S counting <s> and </s>);
        # transformers and CTranslate2 take one limit per call: the batch's longest
        limit = min(max(math.floor(a * len(i) + b) for i in ids), config.max_len)
        prepared.append(PreparedBatch([i for i, _ in batch], src, strings, limit))
    n = sum(len(batch) for batch in batches)
    return PreparedSplit(prepared, n, config.eos_id, config.pad_id)


def ours_runner(source: ExportSource, split: PreparedSplit, k: int) -> Runner:
    """Our greedy (k = 1) or beam search, one batch at a time on torch's intra-op threads."""
    decoding = source.decoding
    alpha = float(decoding["length_penalty"])
    a, b = float(decoding["max_len_a"]), float(decoding["max_len_b"])

    def run(first: int | None = None) -> list[list[int]]:
        results = []
        for batch in split.batches[:first]:
            if k == 1:
                tokens = greedy_search(source.model, batch.src, max_len_a=a, max_len_b=b)
            else:
                tokens = beam_search(
                    source.model, batch.src, beam_size=k, length_penalty=alpha, max_len_a=a, max_len_b=b
                )[0][:, 0]
            results.append((batch.indices, tokens.tolist()))
        return split.collect(results)

    return run


def ct2_translator(directory: Path, compute_type: str, threads: int, parallel: int) -> Any:
    """CTranslate2 with `threads` threads in all: one batch at a time on all of them (parallel = 1), or
    `parallel` batches at once (its inter_threads) on threads / parallel each."""
    import ctranslate2

    from transformer.interop.ctranslate2 import keeping_torch_threads

    with keeping_torch_threads():  # else torch (ours, decoding after it) would run on intra_threads
        return ctranslate2.Translator(
            str(directory),
            device="cpu",
            compute_type=compute_type,
            inter_threads=parallel,
            intra_threads=max(threads // parallel, 1),
        )


def ct2_runner(
    translator: Any, split: PreparedSplit, k: int, alpha: float, vocabulary: dict[str, int]
) -> Runner:
    """CTranslate2's translate_batch, every batch queued at once: with inter_threads > 1, that many run
    together."""

    def run(first: int | None = None) -> list[list[int]]:
        pending = [
            (
                batch.indices,
                translator.translate_batch(
                    batch.strings,
                    beam_size=k,
                    length_penalty=alpha,
                    max_decoding_length=batch.limit - 1,
                    asynchronous=True,
                ),
            )
            for batch in split.batches[:first]
        ]
        return split.collect(
            [
                (indices, [[vocabulary[t] for t in r.result().hypotheses[0]] for r in out])
                for indices, out in pending
            ]
        )

    return run


def hf_runner(marian: Any, split: PreparedSplit, k: int, alpha: float) -> Runner:
    """transformers' MarianMTModel.generate, one batch at a time."""

    def run(first: int | None = None) -> list[list[int]]:
        results = []
        with torch.no_grad():
            for batch in split.batches[:first]:
                generated = marian.generate(
                    input_ids=batch.src, attention_mask=batch.src.ne(split.pad), num_beams=k,
                    length_penalty=alpha, max_new_tokens=batch.limit,
                )  # fmt: skip
                results.append((batch.indices, generated[:, 1:].tolist()))  # without the decoder start token
        return split.collect(results)

    return run


def deploy_methods(
    source: ExportSource, batches: list[list[tuple[int, str]]], tmp: Path, threads: int
) -> dict[str, Runner]:
    """The decoders to time on `batches`, ours first (with the checkpoint's beam, then greedy): the
    checkpoint is exported to `tmp` (CTranslate2 float32 and int8, transformers)."""
    from transformers import AutoModelForSeq2SeqLM
    from transformers.utils import logging as hf_logging

    from transformer.interop.ctranslate2 import export_ctranslate2
    from transformer.interop.export_hf import export_hf

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    beam, alpha = int(source.decoding["beam_size"]), float(source.decoding["length_penalty"])
    split = prepare(source, batches)
    export_ctranslate2(source, tmp / "ct2")
    export_ctranslate2(source, tmp / "ct2_int8", quantization="int8")
    export_hf(source, tmp / "hf")
    vocabulary = {token: i for i, token in enumerate(source.vocabulary("tgt"))}
    translators: dict[tuple[str, int], Any] = {}  # one per directory and number of parallel batches

    def ct2(directory: str, compute_type: str, k: int, parallel: int = 1) -> Runner:
        if (directory, parallel) not in translators:
            translators[directory, parallel] = ct2_translator(
                tmp / directory, compute_type, threads, parallel
            )
        return ct2_runner(translators[directory, parallel], split, k, alpha, vocabulary)

    marian = AutoModelForSeq2SeqLM.from_pretrained(tmp / "hf").eval()
    return {
        f"ours beam{beam}": ours_runner(source, split, beam),
        # CTranslate2 as deployed on `threads` cores: that many batches at once, one thread each
        f"ctranslate2 float32 beam{beam}": ct2("ct2", "float32", beam, parallel=threads),
        f"ctranslate2 int8 beam{beam}": ct2("ct2_int8", "int8", beam, parallel=threads),
        # one batch at a time on every thread (intra_threads=threads)
        f"ctranslate2 int8 beam{beam}, 1x{threads} thr": ct2("ct2_int8", "int8", beam),
        f"transformers generate beam{beam}": hf_runner(marian, split, beam, alpha),
        "ours greedy": ours_runner(source, split, 1),
        "ctranslate2 float32 greedy": ct2("ct2", "float32", 1, parallel=threads),
        "transformers generate greedy": hf_runner(marian, split, 1, alpha),
    }
