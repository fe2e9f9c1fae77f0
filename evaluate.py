"""Evaluation entry point: checkpoint -> model + datamodule -> decode / score -> metrics, report, plots.

    python evaluate.py ckpt_path=PATH [data.test_split=NAME] [data.data_dir=DIR] [decode.beam_size=4]
    python evaluate.py ckpt_path=PATH translate.input=-     # translate stdin to stdout
    python evaluate.py ckpt_path=CLS.ckpt classify.input=-  # label stdin's lines with a classifier
    python evaluate.py -m ckpt_path=PATH decode.beam_size=1,4    # a decoding sweep
    python evaluate.py 'ckpt_path=[A,B,C]' decode=beam        # an ensemble (mean of the probabilities)

`evaluate(cfg)` is importable; `main()` is the command line. The checkpoint is read with
`torch.load(weights_only=True)` and restored without Lightning (`transformer.evaluation`); the steps
are in `transformer.cli` (evaluate_steps, text_io, errors); this file is the order they run in.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from transformer.cli import errors, evaluate_steps, results, text_io, text_translation
from transformer.evaluation.restore import restore_model
from transformer.evaluation.scoring import checkpoint_decoding
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
    paths_given = evaluate_steps.checkpoint_paths(cfg)
    options = evaluate_steps.report_options(cfg.report)  # checked before the checkpoint is even read
    evaluate_steps.check_translate(cfg.get("translate"))
    members = [evaluate_steps.load_checkpoints(cfg, path) for path in paths_given]
    restored_all = [restore_model(checkpoint, paths[-1]) for checkpoint, paths in members]
    restored, paths = restored_all[0], members[0][1]  # the first model: data, tokenizers, report
    evaluate_steps.check_options(cfg, restored, paths[-1])
    model = evaluate_steps.ensemble_of(restored_all, paths_given, cfg.get("ensemble_weights"))
    device = evaluate_steps.device_from_name(str(cfg.get("device") or "cpu"))
    model.to(device)
    progress = bool(cfg.get("progress", True))
    data = dict(cfg.get("data") or {})
    first = data.pop("test_sentences", None)  # evaluate.py's own: not a datamodule setting
    datamodule = evaluate_steps.build_datamodule(restored, data, paths[-1], progress)
    translating = cfg.get("translate", {}).get("input") is not None
    classifying = (cfg.get("classify") or {}).get("input") is not None
    evaluate_steps.keep_first_sentences(datamodule, first, translating or classifying)
    decoding = None
    if restored.task == "translation":
        saved = checkpoint_decoding(restored.hparams)
        decoding = DecodingSettings.from_values(cfg.get("decode"), saved, prefix="decode.")
    torch.manual_seed(evaluate_steps.seed(cfg))  # sampling's draws: the same command, the same output
    if translating:
        targets = text_translation.target_languages(restored_all, paths_given)
        text_io.translate_stream(cfg.translate, model, datamodule, decoding, device, targets)
        return {}
    if classifying:
        text_io.classify_stream(cfg.classify, model, datamodule, restored.class_names, device)
        return {}
    out_dir = Path(cfg.paths.output_dir)
    evaluate_steps.check_new_output_dir(out_dir, _RESULT_FILES)
    split = datamodule.splits["test"]
    loader = datamodule.test_dataloader()  # loads and tokenizes the split: unknown / unlabeled ones fail here
    batches = text_io.progress(text_io.on_device(loader, device), len(loader), f"Scoring {split}", progress)
    info = evaluate_steps.run_info(cfg, restored, paths, datamodule, split, device, paths_given)
    metrics, files = evaluate_steps.score_and_write(
        out_dir,
        restored,
        model,
        datamodule,
        split,
        batches,
        decoding,
        info,
        options,
        paths[-1],
        learning_curves=bool(cfg.report.get("learning_curves", True)),
    )
    text_io.log_to_loggers(cfg, metrics, files)
    log.info("Wrote %s", ", ".join(sorted(p.name for p in files.values() if p.parent == out_dir)))
    return metrics


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
