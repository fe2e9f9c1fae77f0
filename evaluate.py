"""Evaluation entry point: checkpoint -> model + datamodule -> decode / score -> metrics, report, plots.

    python evaluate.py ckpt_path=PATH [data.test_split=NAME] [data.data_dir=DIR] [decode.beam_size=4]
    python evaluate.py ckpt_path=RUN_DIR average_last=5          # average the last 5 checkpoints first
    python evaluate.py -m ckpt_path=PATH decode.beam_size=1,4    # a decoding sweep
    echo "a sentence" | python evaluate.py ckpt_path=PATH translate.input=-   # translations on stdout

`evaluate(cfg)` is importable; `main()` is the command line. The checkpoint is read with
`weights_only=True` and its config only as data: the datamodule class comes from a fixed table, never
from a `_target_` inside the checkpoint, and the tokenizer(s) saved with it are used as they are.
Results go to this run's own directory (Hydra's), never into the training run.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.datamodules import ClassificationDataModule, TranslationDataModule
from data.sources import DataError
from transformer.checkpoint import CheckpointError, average_checkpoints, load_checkpoint
from transformer.cli import errors as cli
from transformer.cli.arguments import ArgumentError, check_arguments
from transformer.evaluation.plots import read_learning_curves
from transformer.evaluation.reports import (
    ReportOptions,
    write_classification_outputs,
    write_translation_outputs,
)
from transformer.evaluation.restore import RestoredModel, last_checkpoints, restore_model
from transformer.evaluation.scoring import (
    checkpoint_decoding,
    decoding_settings,
    score_classification,
    score_translation,
    stream_lines,
    translate,
)

log = logging.getLogger("evaluate")

PROJECT_ROOT = Path(__file__).resolve().parent
_DATAMODULES = {"translation": TranslationDataModule, "classification": ClassificationDataModule}
_RESULT_FILES = ("metrics.json", "report.md", "hypotheses.txt", "predictions.tsv", "checkpoints")


class EvalError(ValueError):
    """An evaluation option that cannot work: reported as one line naming the key, exit status 1."""


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Score `cfg.ckpt_path` on a split (or translate `cfg.translate.input`); returns the metrics."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.get("ckpt_path"):
        raise EvalError("ckpt_path is required: python evaluate.py ckpt_path=PATH/TO/checkpoint.ckpt")
    _report_options(cfg.report)  # every option checked before the checkpoint is even read
    _check_translate(cfg.get("translate"))
    checkpoint, paths = _load(cfg)
    restored = restore_model(checkpoint, paths[-1])
    _check_options(cfg, restored, paths[-1])
    device = _device(str(cfg.get("device") or "cpu"))
    restored.model.to(device)
    datamodule = build_datamodule(restored, cfg.get("data") or {}, paths[-1], bool(cfg.get("progress", True)))
    decoding = None
    if restored.task == "translation":
        decoding = decoding_settings(checkpoint_decoding(restored.hparams), cfg.get("decode") or {})
    if cfg.get("translate", {}).get("input") is not None:
        _translate_stream(cfg.translate, restored, datamodule, decoding, device)
        return {}

    out_dir = Path(cfg.paths.output_dir)
    clashes = [name for name in _RESULT_FILES if (out_dir / name).exists()]
    if clashes:
        raise EvalError(
            f"output directory {out_dir} already holds {clashes}: evaluate writes only into a new one"
        )
    split = datamodule.splits["test"]
    loader = datamodule.test_dataloader()  # loads and tokenizes the split: unknown / unlabeled ones fail here
    batches = _progress(
        _on_device(loader, device), len(loader), f"Scoring {split}", cfg.get("progress", True)
    )
    info = _info(cfg, restored, paths, datamodule, split, device)
    training_run = _training_run_dir(restored, paths[-1])
    curves = read_learning_curves(training_run) if training_run and cfg.report.learning_curves else {}
    options = _report_options(cfg.report)
    tokenizer = datamodule.src_tokenizer
    common = {
        "model": restored.model,
        "encode_source": lambda text: tokenizer.encode(text)[: datamodule.max_len],
        "curves": curves,
        "curves_source": str(training_run) if training_run else None,
        "options": options,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    if restored.task == "translation":
        result = score_translation(
            restored.model,
            batches,
            decode_ids=datamodule.tgt_tokenizer.decode_batch,
            sources=datamodule.sources(split),
            references=datamodule.references(split),
            decoding=decoding,
            label_smoothing=restored.hparams.get("label_smoothing", 0.0),
        )
        files = write_translation_outputs(
            out_dir,
            result,
            info=info,
            decoding=decoding,
            id_to_token=_id_to_token(datamodule.tgt_tokenizer),
            source_id_to_token=_id_to_token(tokenizer),
            **common,
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
        files = write_classification_outputs(
            out_dir, result, info=info, texts=texts, id_to_token=_id_to_token(tokenizer), **common
        )
    metrics = dict(result.metrics)
    _log_to_loggers(cfg, metrics, files)
    log.info("Wrote %s", ", ".join(sorted(p.name for p in files.values() if p.parent == out_dir)))
    return metrics


# --- checkpoint -> model, datamodule ----------------------------------------------------------------


def _load(cfg: DictConfig) -> tuple[dict[str, Any], list[Path]]:
    """The checkpoint to score (averaged over the last N of its run with `average_last`) and its file(s)."""
    path = Path(str(cfg.ckpt_path)).expanduser()
    n = cfg.get("average_last")
    if n is None:
        if path.is_dir():
            raise EvalError(
                f"ckpt_path={path} is a directory: give a .ckpt file (e.g. {path}/checkpoints/last.ckpt), "
                "or add average_last=N to average its last N checkpoints"
            )
        return load_checkpoint(path), [path]
    directory = path.parent if path.is_file() else path
    paths = last_checkpoints(directory, n)
    log.info("Averaging %d checkpoints: %s", len(paths), ", ".join(p.name for p in paths))
    return average_checkpoints(paths), paths


def _check_options(cfg: DictConfig, restored: RestoredModel, path: Path) -> None:
    """Options that do not fit this checkpoint's task: one clear line instead of a silent no-op."""
    expected = cfg.get("task")
    if expected is not None and expected not in ("translation", "classification"):
        raise EvalError(f"task must be translation, classification or null, got {expected!r}")
    if expected is not None and expected != restored.task:
        raise EvalError(f"task={expected} but {path} is a {restored.task} checkpoint")
    if restored.task == "classification":
        decode = {k: v for k, v in (cfg.get("decode") or {}).items() if v is not None}
        if decode:
            keys = ", ".join(f"decode.{k}" for k in decode)
            raise EvalError(
                f"{keys}: decoding options need a translation checkpoint; {path} is a classification one"
            )
        if cfg.get("translate", {}).get("input") is not None:
            raise EvalError(f"translate.input needs a translation checkpoint; {path} is a classification one")


def build_datamodule(
    restored: RestoredModel, overrides: Mapping[str, Any], path: Path, show_progress: bool = False
) -> Any:
    """The training run's datamodule settings with the non-null `overrides`, and the saved tokenizer(s)."""
    cls = _DATAMODULES[restored.task]
    saved = restored.run_config.get("data")
    if not isinstance(saved, Mapping):
        raise CheckpointError(
            f"checkpoint {path} has no training config with a `data` section (train.py saves one)"
        )
    settings = dict(saved)
    target = str(settings.pop("_target_", cls.__name__))
    if target.rsplit(".", 1)[-1] != cls.__name__:
        raise CheckpointError(f"checkpoint {path}: its data config builds {target}, not a {cls.__name__}")
    accepted = inspect.signature(cls).parameters
    for key, value in settings.items():
        if key not in accepted:
            raise CheckpointError(f"checkpoint {path}: data.{key} is not a {cls.__name__} option")
        if isinstance(value, Mapping) and "_target_" in value:  # only data here; nothing gets built
            raise CheckpointError(
                f"checkpoint {path}: data.{key} names a class to build ({value['_target_']})"
            )
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in accepted:
            raise EvalError(f"data.{key} is not a {cls.__name__} option; options: {sorted(accepted)}")
        settings[key] = value
    try:
        check_arguments(cls, {k: v for k, v in overrides.items() if v is not None}, "data")
    except ArgumentError as err:
        raise EvalError(str(err)) from None
    # The tokenizer(s) come from the checkpoint: no cache to read, nothing to train.
    settings.update(cache_dir=None, show_progress=show_progress)
    try:
        datamodule = cls(**settings)
    except (TypeError, ValueError) as err:
        raise EvalError(f"cannot build the {cls.__name__} of {path}: {err}") from None
    state = restored.datamodule_state
    if not state.get("tokenizers"):
        raise CheckpointError(
            f"checkpoint {path} carries no tokenizer (no {cls.__name__} state): it cannot be decoded "
            "with the vocabulary it was trained with"
        )
    datamodule.load_state_dict({k: v for k, v in state.items() if k != "train_sampler"})
    vocab = restored.model.config.src_vocab_size
    if datamodule.src_tokenizer.vocab_size != vocab:
        raise CheckpointError(
            f"checkpoint {path}: its tokenizer has {datamodule.src_tokenizer.vocab_size} tokens "
            f"but its model expects {vocab}"
        )
    return datamodule


def _report_options(node: DictConfig) -> ReportOptions:
    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict)
    if not isinstance(values.pop("learning_curves", True), bool):  # read here, not by the report writer
        raise EvalError("report.learning_curves must be true or false")
    try:
        return ReportOptions(**values)
    except TypeError as err:
        raise EvalError(f"report: {err} (see configs/eval.yaml for the report options)") from None
    except ValueError as err:
        raise EvalError(f"report.{err}") from None


def _check_translate(node: DictConfig | None) -> None:
    chunk_lines = (node or {}).get("chunk_lines", 256)
    if isinstance(chunk_lines, bool) or not isinstance(chunk_lines, int) or chunk_lines < 1:
        raise EvalError(f"translate.chunk_lines must be an integer >= 1, got {chunk_lines!r}")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise EvalError(f"device={name!r} is not a device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"device={name} but CUDA is not available here (use device=cpu)")
    return device


def _training_run_dir(restored: RestoredModel, path: Path) -> Path | None:
    """Where the checkpoint's training run logged its curves (recorded in its config, else next to it)."""
    recorded = restored.run_config.get("paths", {}).get("output_dir")
    for candidate in (recorded, path.parent.parent if path.parent.name == "checkpoints" else None):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def _info(
    cfg: DictConfig,
    restored: RestoredModel,
    paths: list[Path],
    datamodule: Any,
    split: str,
    device: torch.device,
) -> dict[str, Any]:
    return {
        "task": restored.task,
        "checkpoint": str(paths[-1].resolve()),
        "averaged_from": [str(p.resolve()) for p in paths] if cfg.get("average_last") else None,
        "global_step": restored.global_step,
        "epoch": restored.epoch,
        "data_source": getattr(datamodule, "source", None),
        "data_dir": None if datamodule.data_dir is None else str(datamodule.data_dir),
        "split": split,
        "num_examples": len(datamodule.sources(split)),
        "device": str(device),
    }


def _id_to_token(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "tokenizer", None)  # BPETokenizer wraps a `tokenizers.Tokenizer`
    if backend is None:
        return str
    return lambda i: backend.id_to_token(i) or str(i)


# --- batches -----------------------------------------------------------------------------------------


def _on_device(batches: Iterable[Mapping[str, Any]], device: torch.device) -> Iterator[dict[str, Any]]:
    for batch in batches:
        yield {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _progress(batches: Iterable[Any], total: int, desc: str, enabled: bool) -> Iterable[Any]:
    return tqdm(batches, total=total, desc=desc, unit="batch", file=sys.stderr, disable=not enabled)


# --- translating text --------------------------------------------------------------------------------


def _translate_stream(
    options: DictConfig, restored: RestoredModel, datamodule: Any, decoding: Any, device: torch.device
) -> None:
    """Translate lines from stdin or a file to stdout or a file, one output line per input line."""
    source, target = str(options.input), options.get("output")
    if source != "-" and not Path(source).is_file():
        raise EvalError(f"translate.input={source} is not a file (use - for stdin)")
    interactive = source == "-" and sys.stdin.isatty()
    if interactive:
        log.info("Type a sentence and press Enter (Ctrl-D ends)")

    def translate_texts(texts: list[str]) -> list[str]:
        datamodule.predict_texts = texts
        outputs = [""] * len(texts)
        for batch in _on_device(datamodule.predict_dataloader(), device):
            ids = translate(restored.model, batch["src"], decoding).tolist()
            for index, text in zip(batch["id"].tolist(), datamodule.tgt_tokenizer.decode_batch(ids)):
                outputs[index] = text
        return outputs

    with contextlib.ExitStack() as stack:
        reader = sys.stdin if source == "-" else stack.enter_context(open(source, encoding="utf-8"))
        writer = (
            sys.stdout
            if target in (None, "-")
            else stack.enter_context(open(str(target), "w", encoding="utf-8"))
        )
        chunk = 1 if interactive else options.get("chunk_lines", 256)
        stream_lines(reader, writer, translate_texts, chunk_lines=chunk)


# --- loggers -------------------------------------------------------------------------------------------


def _log_to_loggers(cfg: DictConfig, metrics: Mapping[str, float], files: Mapping[str, Path]) -> None:
    """Metrics (and, for wandb, the report's images) to the loggers configured with `logger=...`."""
    for name, node in (cfg.get("logger") or {}).items():
        if node is None:
            continue
        logger = hydra.utils.instantiate(node, _convert_="all")
        logger.log_metrics(dict(metrics))
        images = {key: path for key, path in files.items() if path.suffix == ".png"}
        if images and hasattr(logger, "log_image"):
            for key, path in sorted(images.items()):
                logger.log_image(key=f"eval/{key}", images=[str(path)])
        log.info("Logged metrics%s to logger %s", " and images" if images else "", name)
        if hasattr(logger, "finalize"):
            logger.finalize("success")
        if name == "wandb" and hasattr(logger, "experiment"):
            logger.experiment.finish()


# --- command line --------------------------------------------------------------------------------------


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        metrics = evaluate(cfg)
    except (EvalError, CheckpointError, DataError, ValueError) as err:
        message = " ".join(str(err).split())  # one line on stderr, nothing on stdout
        _traceback_to_log_file(message)
        raise SystemExit(f"error: {message}") from None
    if not metrics:  # translate mode: stdout holds the translations only
        return None
    width = max(len(k) for k in metrics)
    for name, value in sorted(metrics.items()):
        print(f"{name:<{width}}  {value:.4f}")
    print(f"output directory: {HydraConfig.get().runtime.output_dir}")
    sys.stdout.flush()
    primary = "test/bleu" if "test/bleu" in metrics else "test/acc"
    return metrics.get(primary)


def _traceback_to_log_file(message: str) -> None:
    """The full traceback goes to the run's log file only (the console gets the one-line message)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), sys.exc_info())
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def main() -> None:
    """`python evaluate.py ...`: paths resolve against the repository root unless PROJECT_ROOT is set."""
    os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))
    cli.run(_hydra_main, PROJECT_ROOT / "configs", lambda err: None)


if __name__ == "__main__":
    main()
