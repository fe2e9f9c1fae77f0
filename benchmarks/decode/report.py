"""The table of `bench_decode.py --export-ckpt`: each method's speed against ours with the same search,
its BLEU, the share of sentences identical to ours, and why a float32 export's beam search differs."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from benchmarks.common.timing import paired_ratio
from transformer.model import Seq2SeqTransformer

if TYPE_CHECKING:
    from transformer.interop.source import ExportSource


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


def explain_differences(
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


def deploy_table(
    source: ExportSource,
    texts: list[str],
    references: list[str],
    times: dict[str, list[float]],
    outputs: dict[str, list[list[int]]],
) -> dict[str, dict]:
    """Print the table (and each float32 export's differences from ours) and return its rows. The first
    method is ours with the checkpoint's beam; greedy rows compare against "ours greedy"."""
    from data.tokenization import BPETokenizer
    from transformer.evaluation.scoring import corpus_scores

    beam_reference = next(iter(times))
    src_tokenizer = BPETokenizer.from_json(source.src_tokenizer_json)
    tgt_tokenizer = BPETokenizer.from_json(source.tgt_tokenizer_json)
    src_ids = [torch.tensor(ids) for ids in src_tokenizer.encode_batch(texts)]
    alpha = float(source.decoding["length_penalty"])
    rows: dict[str, dict] = {}
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
            rows[name]["differences"] = explain_differences(
                source.model, src_ids, outputs[reference], outputs[name], alpha, counts_eos=name[0] == "t"
            )
        row = rows[name]
        print(f"{name:32} {sent_s:8.2f} {row['speedup']:7.2f} {row['bleu']:6.2f} {100 * same:6.1f}%")
    for name, row in rows.items():
        if "differences" in row:
            print(f"  {name} vs ours: " + ", ".join(f"{k} {v}" for k, v in row["differences"].items()))
    return rows
