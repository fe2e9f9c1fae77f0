"""Evaluation entry point: checkpoint -> model + datamodule -> decode / score -> metrics, report, plots.

    python evaluate.py ckpt_path=PATH [data.test_split=NAME] [data.data_dir=DIR] [decode.beam_size=4]
    python evaluate.py ckpt_path=PATH translate.input=-     # translate stdin to stdout
    python evaluate.py ckpt_path=CLS.ckpt classify.input=-  # label stdin's lines with a classifier
    python evaluate.py -m ckpt_path=PATH decode.beam_size=1,4    # a decoding sweep
    python evaluate.py 'ckpt_path=[A,B,C]' decode=beam        # an ensemble (mean of the probabilities)

`evaluate(cfg)` is importable; `main()` is the command line. The checkpoint is read with
`torch.load(weights_only=True)` and restored without Lightning (`transformer.evaluation`); the steps
are in `transformer.cli` (checkpoint_setup, text_io, errors); this file is the order they run in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from transformer.cli import checkpoint_setup, errors, results, text_io, word_alignments
from transformer.disk import write_text
from transformer.evaluation.n_best import write_n_best
from transformer.evaluation.plots import read_learning_curves
from transformer.evaluation.reports import (
    ReportInputs,
    ReportOptions,
    write_classification_outputs,
    write_translation_outputs,
)
from transformer.evaluation.restore import RestoredModel, restore_model
from transformer.evaluation.scoring import checkpoint_decoding, score_classification, score_translation
from transformer.search.decoding import DecodingSettings

log = logging.getLogger("evaluate")

PROJECT_ROOT = Path(__file__).resolve().parent
_RESULT_FILES = (
    "metrics.json",
    "report.md",
    "hypotheses.txt",
    "predictions.tsv",
    "nbest.txt",
    "alignments.txt",
    "checkpoints",
)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Score `cfg.ckpt_path` (a checkpoint, or a list of them: an ensemble) on a split (or translate
    `cfg.translate.input`); returns the metrics."""
    paths_given = checkpoint_setup.checkpoint_paths(cfg)
    options = checkpoint_setup.report_options(cfg.report)  # checked before the checkpoint is even read
    checkpoint_setup.check_translate(cfg.get("translate"))
    members = [checkpoint_setup.load_checkpoints(cfg, path) for path in paths_given]
    restored_all = [restore_model(checkpoint, paths[-1]) for checkpoint, paths in members]
    restored, paths = restored_all[0], members[0][1]  # the first model: data, tokenizers, report
    checkpoint_setup.check_options(cfg, restored, paths[-1])
    model = checkpoint_setup.ensemble_of(restored_all, paths_given, cfg.get("ensemble_weights"))
    device = checkpoint_setup.device_from_name(str(cfg.get("device") or "cpu"))
    model.to(device)
    progress = bool(cfg.get("progress", True))
    data = dict(cfg.get("data") or {})
    first = data.pop("test_sentences", None)  # evaluate.py's own: not a datamodule setting
    datamodule = checkpoint_setup.build_datamodule(restored, data, paths[-1], progress)
    translating = cfg.get("translate", {}).get("input") is not None
    classifying = (cfg.get("classify") or {}).get("input") is not None
    checkpoint_setup.keep_first_sentences(datamodule, first, translating or classifying)
    decoding = None
    if restored.task == "translation":
        saved = checkpoint_decoding(restored.hparams)
        decoding = DecodingSettings.from_values(cfg.get("decode"), saved, prefix="decode.")
    torch.manual_seed(checkpoint_setup.seed(cfg))  # sampling's draws: the same command, the same output
    if translating:
        text_io.translate_stream(cfg.translate, model, datamodule, decoding, device)
        return {}
    if classifying:
        text_io.classify_stream(cfg.classify, model, datamodule, restored.class_names, device)
        return {}
    out_dir = Path(cfg.paths.output_dir)
    checkpoint_setup.check_new_output_dir(out_dir, _RESULT_FILES)
    split = datamodule.splits["test"]
    loader = datamodule.test_dataloader()  # loads and tokenizes the split: unknown / unlabeled ones fail here
    batches = text_io.progress(text_io.on_device(loader, device), len(loader), f"Scoring {split}", progress)
    info = checkpoint_setup.run_info(cfg, restored, paths, datamodule, split, device, paths_given)
    metrics, files = score_and_write(
        cfg, restored, model, datamodule, split, batches, decoding, info, options, paths[-1]
    )
    text_io.log_to_loggers(cfg, metrics, files)
    log.info("Wrote %s", ", ".join(sorted(p.name for p in files.values() if p.parent == out_dir)))
    return metrics


def score_and_write(
    cfg: DictConfig,
    restored: RestoredModel,
    model: Any,
    datamodule: Any,
    split: str,
    batches: Iterable[Mapping[str, Any]],
    decoding: DecodingSettings | None,
    info: dict[str, Any],
    options: ReportOptions,
    path: Path,
) -> tuple[dict[str, float], dict[str, Path]]:
    """Decode / classify `batches` of `split` with `model` (restored's, or an ensemble), then write the
    outputs, the report and its plots (attention maps: restored's model)."""
    out_dir = Path(cfg.paths.output_dir)
    training_run = checkpoint_setup.training_run_dir(restored, path)
    tokenizer = datamodule.src_tokenizer
    inputs = ReportInputs(
        info=info,
        model=restored.model,
        encode_source=lambda text: tokenizer.encode(text)[: datamodule.max_len],
        id_to_token=checkpoint_setup.id_to_token(
            datamodule.tgt_tokenizer if restored.task == "translation" else tokenizer
        ),
        source_id_to_token=checkpoint_setup.id_to_token(tokenizer),
        curves=read_learning_curves(training_run) if training_run and cfg.report.learning_curves else {},
        curves_source=str(training_run) if training_run else None,
        options=options,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    if restored.task == "translation":
        result = score_translation(
            model,
            batches,
            decode_ids=datamodule.tgt_tokenizer.decode_batch,
            sources=datamodule.sources(split),
            references=datamodule.references(split),
            decoding=decoding,
            label_smoothing=restored.hparams.get("label_smoothing", 0.0),
        )
        files = write_translation_outputs(out_dir, result, inputs, decoding=decoding)
        if result.n_best:
            files["nbest"] = write_n_best(out_dir / "nbest.txt", result.n_best)
        if decoding is not None and decoding.alignments:
            files["alignments"] = write_alignments(
                out_dir / "alignments.txt", model, datamodule, result, decoding
            )
    else:
        texts = datamodule.sources(split)
        result = score_classification(
            restored.model,
            batches,
            num_examples=len(texts),
            class_names=datamodule.class_names,
            label_smoothing=restored.hparams.get("label_smoothing", 0.0),
        )
        files = write_classification_outputs(out_dir, result, inputs, texts=texts)
    return dict(result.metrics), files


def write_alignments(
    path: Path, model: Any, datamodule: Any, result: Any, decoding: DecodingSettings
) -> Path:
    """decode.alignments=true: the hypotheses' word alignments (Pharaoh), one line per sentence; with
    decode.n_best > 1 one `id ||| pairs` line per hypothesis, as nbest.txt and translate.input do."""
    config = model.config
    specials = {config.pad_id, config.bos_id, config.eos_id}
    aligner = word_alignments.Aligner(
        model,
        decoding.alignment_layer,
        word_alignments.piece_function(datamodule.src_tokenizer, specials),
        word_alignments.piece_function(datamodule.tgt_tokenizer, specials),
    )
    device = next(model.parameters()).device
    tokenizer = datamodule.src_tokenizer
    n_best = bool(result.n_best)
    ids = result.n_best_ids if n_best else [[ids] for ids in result.hypothesis_ids]
    texts = (
        [[text for text, _ in hyps] for hyps in result.n_best] if n_best else [[h] for h in result.hypotheses]
    )
    lines = word_alignments.split_alignment_lines(
        aligner,
        lambda text: tokenizer.encode(text)[: datamodule.max_len],
        result.sources,
        ids,
        texts,
        config.pad_id,
        device,
    )
    text = "".join(
        f"{i} ||| {line}\n" if n_best else f"{line}\n"
        for i, sentence in enumerate(lines)
        for line in sentence
    )
    return write_text(path, text, "the word alignments")


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        metrics = evaluate(cfg)
    except (*errors.USER_ERRORS, ValueError) as err:  # one line on stderr, nothing on stdout
        raise errors.user_error(err) from None
    except Exception as err:  # a full disk under any of its writes: one line, too
        exit_ = errors.disk_full_exit(err, cfg.paths.output_dir)
        if exit_ is None:
            raise
        raise exit_ from None
    if not metrics:  # translate / classify mode: stdout holds the translations or labels only
        return None
    results.print_metrics(metrics, f"output directory: {HydraConfig.get().runtime.output_dir}")
    return metrics.get("test/bleu" if "test/bleu" in metrics else "test/acc")


def main() -> None:
    """`python evaluate.py ...`: paths resolve against the repository root unless PROJECT_ROOT is set."""
    os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))
    errors.run(_hydra_main, PROJECT_ROOT / "configs", lambda err: None)


if __name__ == "__main__":
    main()
