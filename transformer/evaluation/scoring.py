"""Scoring a trained network on one split: decoded sacreBLEU (translation) or label metrics
(classification).

The functions take the datamodules' batch dicts and return plain results; the numbers are computed exactly
as the tasks of `transformer.training` compute their `test/*` metrics, so evaluating a checkpoint reproduces
what its training run reported. No Hydra, no files, no `data/` here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import sacrebleu
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassCalibrationError,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
    MulticlassPrecision,
    MulticlassRecall,
)

from transformer.evaluation.n_best import n_best_texts, until_eos
from transformer.evaluation.restore import checkpoint_decoding
from transformer.losses import label_smoothed_cross_entropy
from transformer.model import Seq2SeqTransformer, TransformerClassifier
from transformer.search.decoding import DecodingSettings, search
from transformer.search.ensemble import Ensemble

__all__ = [
    "ClassificationResult",
    "TranslationResult",
    "attention_maps",
    "checkpoint_decoding",
    "corpus_scores",
    "direction_scores",
    "score_classification",
    "score_signatures",
    "score_translation",
]

Batch = Mapping[str, Tensor]


# --- translation ------------------------------------------------------------------------------------


@dataclass
class TranslationResult:
    """Corpus metrics plus per-sentence outputs, all lists in split order (index = example id)."""

    metrics: dict[str, float]
    signatures: dict[str, str]  # sacreBLEU signatures of the BLEU and chrF scores
    sources: list[str]
    references: list[str]
    hypotheses: list[str]
    hypothesis_ids: list[list[int]]  # token ids without BOS, up to and including EOS
    sentence_bleu: list[float]
    # with n_best > 1: per sentence its hypotheses (text, the search's score), best first; else empty
    n_best: list[list[tuple[str, float]]] = field(default_factory=list)
    n_best_ids: list[list[list[int]]] = field(default_factory=list)  # their token ids, as hypothesis_ids
    # a multilingual split: the direction ("en-de") of each sentence; empty for a single direction
    directions: list[str] = field(default_factory=list)
    # the target-language labels the sources carry (">>de<<"): not words of the source when counted
    source_labels: list[str] = field(default_factory=list)


# force: hypotheses are detokenized by our tokenizer; references may keep " ." as they ship
SCORERS = {
    "bleu": sacrebleu.BLEU(force=True),
    "bleu_lc": sacrebleu.BLEU(lowercase=True, force=True),
    "chrf": sacrebleu.CHRF(),
}


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus sacreBLEU (cased, detokenized, 13a), lowercased BLEU (`bleu_lc`, for comparison with
    published lowercased numbers), chrF and sentence exact match, in percent. The training task's
    val/test metrics and `evaluate.py` both come from here."""
    if not hypotheses:
        return {name: 0.0 for name in (*SCORERS, "exact_match")}
    hyps, refs = list(hypotheses), [list(references)]
    exact = sum(h.strip() == r.strip() for h, r in zip(hypotheses, references))
    return {
        "bleu": SCORERS["bleu"].corpus_score(hyps, refs).score,
        "bleu_lc": SCORERS["bleu_lc"].corpus_score(hyps, refs).score,
        "chrf": SCORERS["chrf"].corpus_score(hyps, refs).score,
        "exact_match": 100.0 * exact / len(hyps),
    }


def score_signatures() -> dict[str, str]:
    """sacreBLEU signatures of `corpus_scores`' metrics (what a paper should print beside the numbers)."""
    return {name: str(scorer.get_signature()) for name, scorer in SCORERS.items()}


def score_translation(
    model: Seq2SeqTransformer | Ensemble,
    batches: Iterable[Batch],
    *,
    decode_ids: Callable[[list[list[int]]], list[str]],
    sources: Sequence[str],
    references: Sequence[str],
    decoding: DecodingSettings,
    label_smoothing: float,
    stage: str = "test",
    directions: Sequence[str] | None = None,
    source_labels: Sequence[str] = (),
) -> TranslationResult:
    """Teacher-forced loss / perplexity / token accuracy and decoded BLEU / chrF / exact match.

    `decode_ids` turns hypothesis token ids into detokenized text (the target tokenizer's
    `decode_batch`); `sources` / `references` are the raw texts of the split, indexed by `batch["id"]`.
    BLEU and the other corpus scores use each sentence's best hypothesis; with `decoding.n_best` > 1
    the result also holds every sentence's n-best list. `directions` (a multilingual split: each
    sentence's direction, by id) scores each direction and takes their means as the corpus scores
    (`transformer.evaluation.directions`, as validation does); `source_labels` the target-language labels
    in its sources (kept with the result: BLEU by source length does not count them as words).
    """
    model.eval()
    sums = {"loss": 0.0, "nll": 0.0, "correct": 0.0, "tokens": 0.0}
    hypotheses: dict[int, tuple[str, list[int]]] = {}
    n_best: dict[int, list[tuple[str, float]]] = {}
    n_best_ids: dict[int, list[list[int]]] = {}
    eos_id, pad_id = model.config.eos_id, model.config.pad_id
    with torch.no_grad():
        for batch in batches:
            _add_teacher_forced(sums, model, batch, label_smoothing)
            tokens, scores = search(model, batch["src"], decoding)  # (B, N, L), (B, N) best first
            lists = n_best_texts(tokens, scores, decode_ids, eos_id, pad_id)
            for index, hyps, rows in zip(batch["id"].tolist(), lists, tokens):
                hypotheses[index] = (hyps[0][0], until_eos(rows[0], eos_id, pad_id))
                if decoding.n_best > 1:  # the kept hypotheses are the first ones (best first)
                    n_best[index] = hyps
                    n_best_ids[index] = [until_eos(row, eos_id, pad_id) for row in rows[: len(hyps)]]
    _check_every_example(hypotheses, len(references))
    hyps = [hypotheses[i][0] for i in range(len(references))]
    refs = list(references)
    sentence = sacrebleu.BLEU(effective_order=True)  # sentence BLEU needs effective order
    return TranslationResult(
        metrics=_translation_metrics(sums, hyps, refs, stage, directions),
        signatures=score_signatures(),
        sources=list(sources),
        references=refs,
        hypotheses=hyps,
        hypothesis_ids=[hypotheses[i][1] for i in range(len(references))],
        sentence_bleu=[sentence.sentence_score(h, [r]).score for h, r in zip(hyps, refs)],
        n_best=[n_best[i] for i in range(len(references))] if n_best else [],
        n_best_ids=[n_best_ids[i] for i in range(len(references))] if n_best else [],
        directions=list(directions or []),
        source_labels=list(source_labels),
    )


def _add_teacher_forced(
    sums: dict[str, float], model: Seq2SeqTransformer | Ensemble, batch: Batch, label_smoothing: float
) -> None:
    """Adds one batch's token-weighted loss and NLL, correct tokens and tokens to `sums`."""
    pad_id = model.config.pad_id
    tgt_out = batch["tgt_out"]
    keep = tgt_out.ne(pad_id)  # (B, T)
    # as the training task: the layers and the (D x V) projection run on the non-pad positions only
    logits = model(batch["src"], batch["tgt_in"], positions=keep)  # (N, V); an ensemble: log mean probs
    out = label_smoothed_cross_entropy(
        logits, tgt_out[keep], ignore_index=pad_id, label_smoothing=label_smoothing
    )
    n = float(out.n_tokens)
    sums["loss"] += float(out.loss) * n  # token-weighted, as the task's MeanMetric
    sums["nll"] += float(out.nll) * n
    sums["correct"] += float(out.n_correct)
    sums["tokens"] += n


def _translation_metrics(
    sums: Mapping[str, float],
    hypotheses: list[str],
    references: list[str],
    stage: str,
    directions: Sequence[str] | None = None,
) -> dict[str, float]:
    tokens = max(sums["tokens"], 1.0)
    nll = sums["nll"] / tokens
    return {
        f"{stage}/loss": sums["loss"] / tokens,
        f"{stage}/nll": nll,
        f"{stage}/ppl": math.exp(nll),
        f"{stage}/token_acc": sums["correct"] / tokens,
        **{f"{stage}/{name}": value for name, value in _corpus(hypotheses, references, directions).items()},
    }


def _corpus(
    hypotheses: list[str], references: list[str], directions: Sequence[str] | None
) -> dict[str, float]:
    return (
        corpus_scores(hypotheses, references)
        if not directions
        else direction_scores(hypotheses, references, directions)
    )


def direction_scores(
    hypotheses: Sequence[str], references: Sequence[str], directions: Sequence[str]
) -> dict[str, float]:
    """`corpus_scores` of each direction's sentences as `{name}_{direction}` ("bleu_en-de"), with
    `n_sentences_{direction}`, and under the plain names their mean over the directions (each direction
    weighs the same, however many sentences it has: a checkpoint good in one direction only is not the
    one selected). Validation and evaluate.py score a multilingual split through here."""
    if not len(hypotheses) == len(references) == len(directions):
        raise ValueError(
            f"{len(hypotheses)} hypotheses, {len(references)} references and {len(directions)} directions"
        )
    chosen: dict[str, list[int]] = {}
    for i, direction in enumerate(directions):
        chosen.setdefault(direction, []).append(i)
    per = {
        direction: corpus_scores([hypotheses[i] for i in rows], [references[i] for i in rows])
        for direction, rows in sorted(chosen.items())
    }
    scores: dict[str, float] = {}
    for direction, values in per.items():
        scores.update({f"{name}_{direction}": value for name, value in values.items()})
        scores[f"n_sentences_{direction}"] = float(len(chosen[direction]))
    for name in next(iter(per.values()), {}):
        scores[name] = sum(values[name] for values in per.values()) / len(per)
    return scores


def _check_every_example(seen: Collection[int], num_examples: int) -> None:
    """Every example id of the split (0 .. num_examples - 1) came through the batches."""
    missing = sorted(set(range(num_examples)) - set(seen))
    if missing:
        raise RuntimeError(
            f"the batches skipped {len(missing)} examples of the split (ids {missing[:5]} ...)"
        )


# --- classification ---------------------------------------------------------------------------------


@dataclass
class ClassificationResult:
    """Metrics plus per-example predictions in split order (index = example id)."""

    metrics: dict[str, float]
    class_names: list[str]
    per_class: dict[str, dict[str, float]]  # name -> precision, recall, f1, support
    confusion: list[list[int]]  # [gold][predicted] counts
    labels: list[int]
    predictions: list[int]
    probabilities: list[list[float]] = field(repr=False)

    @property
    def confidence(self) -> list[float]:
        """The probability of the predicted class, per example."""
        return [p[pred] for p, pred in zip(self.probabilities, self.predictions)]


def score_classification(
    model: TransformerClassifier,
    batches: Iterable[Batch],
    *,
    num_examples: int,
    class_names: Sequence[str],
    label_smoothing: float,
    stage: str = "test",
    calibration_bins: int = 15,
) -> ClassificationResult:
    """Loss, accuracy (micro), macro-F1 as the task logs them, plus per-class scores and calibration error."""
    model.eval()
    C = len(class_names)
    metrics = _classification_metrics(C, calibration_bins)
    loss_sum, count = 0.0, 0
    rows: dict[int, tuple[int, list[float]]] = {}
    labels: dict[int, int] = {}
    with torch.no_grad():
        for batch in batches:
            logits = model(batch["src"]).float()  # (B, C)
            gold = batch["label"]  # (B,)
            loss = F.cross_entropy(logits, gold, label_smoothing=label_smoothing, reduction="sum")
            loss_sum, count = loss_sum + float(loss), count + gold.numel()
            probs = logits.softmax(dim=-1)  # (B, C)
            for metric in metrics.values():
                metric.update(probs, gold)
            for index, label, p in zip(batch["id"].tolist(), gold.tolist(), probs.tolist()):
                rows[index] = (int(max(range(C), key=p.__getitem__)), p)
                labels[index] = label
    _check_every_example(rows, num_examples)
    values = {name: metric.compute() for name, metric in metrics.items()}
    confusion = values["confusion"].tolist()
    return ClassificationResult(
        metrics={
            f"{stage}/loss": loss_sum / max(count, 1),
            f"{stage}/acc": float(values["acc"]),
            f"{stage}/f1": float(values["f1"]),
            f"{stage}/ece": float(values["ece"]),
        },
        class_names=list(class_names),
        per_class=_per_class(values, confusion, class_names),
        confusion=confusion,
        labels=[labels[i] for i in range(num_examples)],
        predictions=[rows[i][0] for i in range(num_examples)],
        probabilities=[rows[i][1] for i in range(num_examples)],
    )


def _classification_metrics(C: int, calibration_bins: int) -> dict[str, Metric]:
    """The torchmetrics behind the scores; each is updated with (probabilities, gold labels)."""
    return {
        "acc": MulticlassAccuracy(C, average="micro"),
        "f1": MulticlassF1Score(C, average="macro"),
        "precision": MulticlassPrecision(C, average=None),
        "recall": MulticlassRecall(C, average=None),
        "f1_per_class": MulticlassF1Score(C, average=None),
        "confusion": MulticlassConfusionMatrix(C),
        "ece": MulticlassCalibrationError(C, n_bins=calibration_bins, norm="l1"),
    }


def _per_class(
    values: Mapping[str, Tensor], confusion: list[list[int]], class_names: Sequence[str]
) -> dict[str, dict[str, float]]:
    """Class name -> precision, recall, F1 and support (gold examples, the confusion matrix's row sum)."""
    return {
        name: {
            "precision": float(values["precision"][c]),
            "recall": float(values["recall"][c]),
            "f1": float(values["f1_per_class"][c]),
            "support": float(sum(confusion[c])),
        }
        for c, name in enumerate(class_names)
    }


# --- attention ----------------------------------------------------------------------------------------


@torch.no_grad()
def attention_maps(
    model: Seq2SeqTransformer | TransformerClassifier, src: Sequence[int], tgt_in: Sequence[int] | None = None
) -> dict[str, list[Tensor]]:
    """One sentence's attention: "encoder_self" (+ "decoder_self", "cross") -> per layer (H, Tq, Tk)."""
    model.eval()
    src_tensor = torch.tensor([list(src)], dtype=torch.long, device=_device(model))  # (1, S)
    if isinstance(model, Seq2SeqTransformer):
        if tgt_in is None:
            raise ValueError("a translation model's attention maps need tgt_in (BOS + target tokens)")
        tgt_tensor = torch.tensor([list(tgt_in)], dtype=torch.long, device=src_tensor.device)  # (1, T)
        maps = model.attention_maps(src_tensor, tgt_tensor)
    else:
        maps = model.attention_maps(src_tensor)
    return {
        kind: [layer[0].float().cpu() for layer in layers] for kind, layers in maps.items()
    }  # (H, Tq, Tk)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
