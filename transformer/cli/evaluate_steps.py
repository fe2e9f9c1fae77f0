"""evaluate.py's steps, in the order it runs them: what a run on saved checkpoints checks and builds first
(the checkpoint, or the average of a run's last ones, or an ensemble of several; the options that must fit
its task; the datamodule with the checkpoint's tokenizer(s); the device, the seed and the report options),
then scoring a split and writing its outputs, report and plots (`score_and_write`). Training uses the
model, datamodule and device parts for distillation's teachers (`distill.teachers`)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from data.datamodules import ClassificationDataModule, TranslationDataModule
from transformer.checkpoint import CheckpointError, average_checkpoints, files_in_hint, load_checkpoint
from transformer.cli import word_alignments
from transformer.cli.arguments import ArgumentError, check_arguments
from transformer.cli.errors import ConfigError
from transformer.cli.init_from import check_languages
from transformer.evaluation.n_best import write_n_best
from transformer.evaluation.plots import read_learning_curves
from transformer.evaluation.reports import (
    ReportInputs,
    ReportOptions,
    write_classification_outputs,
    write_translation_outputs,
)
from transformer.evaluation.restore import RestoredModel, last_checkpoints, lora_settings
from transformer.evaluation.scoring import score_classification, score_translation
from transformer.inference.loading import combined
from transformer.inference.outputs import InferenceError
from transformer.search.decoding import DecodingSettings

log = logging.getLogger("evaluate")


DATAMODULES = {"translation": TranslationDataModule, "classification": ClassificationDataModule}


def checkpoint_paths(cfg: DictConfig) -> list[Path]:
    """`ckpt_path`: one checkpoint, or a non-empty list of them (an ensemble)."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or cfg.get("ckpt_path") in (None, ""):
        raise ConfigError("ckpt_path is required: python evaluate.py ckpt_path=PATH/TO/checkpoint.ckpt")
    value = cfg.ckpt_path
    if not isinstance(value, ListConfig):
        return [Path(str(value)).expanduser()]
    if not value:
        raise ConfigError("ckpt_path=[] names no checkpoint: give one, or a list like '[a.ckpt,b.ckpt]'")
    if cfg.get("average_last") is not None:
        raise ConfigError("average_last averages one run's checkpoints: give a single ckpt_path with it")
    return [Path(str(path)).expanduser() for path in value]


def seed(cfg: DictConfig) -> int:
    value = cfg.get("seed", 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"seed must be an integer, got {value!r}")
    return value


def ensemble_of(
    restored: list[RestoredModel], paths: list[Path], weights: Iterable[float] | None
) -> torch.nn.Module:
    """The model to decode with: the one checkpoint's, or an `Ensemble` of translation checkpoints of
    the same task, labels and tokenizers (`ensemble_weights`: one weight per checkpoint, default equal),
    checked as the inference API checks one (`inference.loading.combined`)."""
    try:
        return combined(restored, paths, weights, weights_key="ensemble_weights")
    except InferenceError as err:
        where = "" if str(err).startswith("ensemble_weights") else "ckpt_path: "
        raise ConfigError(f"{where}{err}") from None


def load_checkpoints(cfg: DictConfig, path: Path) -> tuple[dict[str, Any], list[Path]]:
    """The checkpoint to score (averaged over the last N of its run with `average_last`) and its file(s)."""
    n = cfg.get("average_last")
    if n is None:
        if path.is_dir():
            raise ConfigError(
                f"ckpt_path={path} is a directory: {files_in_hint(path)}, "
                "or add average_last=N to average its last N checkpoints"
            )
        return load_checkpoint(path), [path]
    directory = path.parent if path.is_file() else path
    paths = last_checkpoints(directory, n)
    log.info("Averaging %d checkpoints: %s", len(paths), ", ".join(p.name for p in paths))
    averaged = average_checkpoints(paths)
    if lora_settings(averaged.get("hyper_parameters") or {}, paths[-1]) is not None:
        # the mean of B A over checkpoints is not the product of the mean B and the mean A
        raise ConfigError(
            f"average_last={n}: {paths[-1]} is a LoRA fine-tuning checkpoint, whose adapters cannot be "
            "averaged factor by factor; evaluate one checkpoint (without average_last)"
        )
    return averaged, paths


def check_options(cfg: DictConfig, restored: RestoredModel, path: Path) -> None:
    """Options that do not fit this checkpoint's task: one clear line instead of a silent no-op."""
    expected = cfg.get("task")
    if expected is not None and expected not in ("translation", "classification"):
        raise ConfigError(f"task must be translation, classification or null, got {expected!r}")
    if expected is not None and expected != restored.task:
        raise ConfigError(f"task={expected} but {path} is a {restored.task} checkpoint")
    if restored.task == "classification":
        decode = {k: v for k, v in (cfg.get("decode") or {}).items() if v is not None}
        if decode:
            keys = ", ".join(f"decode.{k}" for k in decode)
            raise ConfigError(
                f"{keys}: decoding options need a translation checkpoint; {path} is a classification one"
            )
        if cfg.get("translate", {}).get("input") is not None:
            raise ConfigError(
                f"translate.input needs a translation checkpoint; {path} is a classification one "
                "(classify.input=FILE or - labels text lines with it)"
            )
    elif (cfg.get("classify") or {}).get("input") is not None:
        raise ConfigError(
            f"classify.input needs a classification checkpoint; {path} is a translation one "
            "(translate.input=FILE or - translates text lines with it)"
        )


def build_datamodule(
    restored: RestoredModel, overrides: Mapping[str, Any], path: Path, show_progress: bool = False
) -> Any:
    """The training run's datamodule settings with the non-null `overrides`, and the saved tokenizer(s)."""
    cls = DATAMODULES[restored.task]
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
            raise ConfigError(f"data.{key} is not a {cls.__name__} option; options: {sorted(accepted)}")
        settings[key] = value
    try:
        check_arguments(cls, {k: v for k, v in overrides.items() if v is not None}, "data")
    except ArgumentError as err:
        raise ConfigError(str(err)) from None
    check_languages(saved, overrides, f"checkpoint {path}", "evaluate it on data in its languages")
    # The tokenizer(s) come from the checkpoint: no cache to read, nothing to train.
    settings.update(cache_dir=None, show_progress=show_progress)
    try:
        datamodule = cls(**settings)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"cannot build the {cls.__name__} of {path}: {err}") from None
    state = dict(restored.datamodule_state)
    if restored.tokenizers:  # the checkpoint's own key (`saved_tokenizers`), else its datamodule state's
        state["tokenizers"] = restored.tokenizers
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


def keep_first_sentences(datamodule: Any, n: Any, translating: bool) -> None:
    """`data.test_sentences=N`: score the split's first N sentences only (a quick look); of each direction
    for a multilingual split."""
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"data.test_sentences must be an integer >= 1 or null, got {n!r}")
    if translating:
        raise ConfigError(
            "data.test_sentences cuts the scored split; translate.input / classify.input read all their lines"
        )
    split = datamodule.splits["test"]
    total = datamodule.keep_first(split, n)
    each = " of each direction" if getattr(datamodule, "multilingual", False) else ""
    log.info(
        "Scoring the first %d%s of the %d sentences of %s (data.test_sentences): %d in all",
        n if each else min(n, total),
        each,
        total,
        split,
        len(datamodule.raw_split(split)),
    )


def report_options(node: DictConfig) -> ReportOptions:
    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict)
    if not isinstance(values.pop("learning_curves", True), bool):  # read here, not by the report writer
        raise ConfigError("report.learning_curves must be true or false")
    try:
        return ReportOptions(**values)
    except TypeError as err:
        raise ConfigError(f"report: {err} (see configs/eval.yaml for the report options)") from None
    except ValueError as err:
        raise ConfigError(f"report.{err}") from None


def check_translate(node: DictConfig | None) -> None:
    chunk_lines = (node or {}).get("chunk_lines", 256)
    if isinstance(chunk_lines, bool) or not isinstance(chunk_lines, int) or chunk_lines < 1:
        raise ConfigError(f"translate.chunk_lines must be an integer >= 1, got {chunk_lines!r}")


def device_from_name(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"device={name!r} is not a device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available here (use device=cpu)")
    return device


def training_run_dir(restored: RestoredModel, path: Path) -> Path | None:
    """Where the checkpoint's training run logged its curves (recorded in its config, else next to it)."""
    recorded = restored.run_config.get("paths", {}).get("output_dir")
    for candidate in (recorded, path.parent.parent if path.parent.name == "checkpoints" else None):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def run_info(
    cfg: DictConfig,
    restored: RestoredModel,
    paths: list[Path],
    datamodule: Any,
    split: str,
    device: torch.device,
    ensemble: list[Path] | None = None,
) -> dict[str, Any]:
    return {
        "task": restored.task,
        "checkpoint": str(paths[-1].resolve()),
        "averaged_from": [str(p.resolve()) for p in paths] if cfg.get("average_last") else None,
        "ensemble": [str(p.resolve()) for p in ensemble] if ensemble and len(ensemble) > 1 else None,
        "ensemble_weights": list(cfg.ensemble_weights) if cfg.get("ensemble_weights") is not None else None,
        "global_step": restored.global_step,
        "epoch": restored.epoch,
        "data_source": getattr(datamodule, "source", None),
        "data_dir": None if datamodule.data_dir is None else str(datamodule.data_dir),
        "split": split,
        "num_examples": len(datamodule.sources(split)),
        "device": str(device),
        **provenance(restored),
        **_cleaning(datamodule, restored),
    }


def _cleaning(datamodule: Any, restored: RestoredModel) -> dict[str, str]:
    """What `data.clean` removed from the training split (docs/cleaning.md), when the training run's
    cache still holds its entry (this datamodule has no cache: its tokenizers are the checkpoint's)."""
    if not hasattr(datamodule, "clean_summary"):
        return {}
    saved = restored.run_config.get("data")
    summary = datamodule.clean_summary(saved.get("cache_dir") if isinstance(saved, Mapping) else None)
    return {"data_cleaning": summary} if summary else {}


def provenance(restored: RestoredModel) -> dict[str, Any]:
    """What the checkpoint was imported from (`imported_from`: source, transformers version, ...), its own
    or that of the `model.init_from` its fine-tuning run started from (`init_from`), logged once."""
    origin = restored.origin
    if origin is None:
        return {}
    imported = {k: v for k, v in origin.items() if k != "labels"}
    start = (restored.started_from or {}).get("init_from") if restored.imported_from is None else None
    log.info(
        "The checkpoint's weights were imported from %s (transformers %s)%s",
        imported.get("source"),
        imported.get("transformers"),
        f", then fine-tuned from {start}" if start else "",
    )
    return {"imported_from": imported, **({"init_from": start} if start else {})}


def id_to_token(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "tokenizer", None)  # BPETokenizer wraps a `tokenizers.Tokenizer`
    if backend is None:
        return str
    return lambda i: backend.id_to_token(i) or str(i)


def check_new_output_dir(out_dir: Path, result_files: Iterable[str]) -> None:
    """evaluate.py writes only into a directory that holds no earlier results."""
    clashes = [name for name in result_files if (out_dir / name).exists()]
    if clashes:
        raise ConfigError(
            f"output directory {out_dir} already holds {clashes}: evaluate writes only into a new one"
        )


def score_and_write(
    out_dir: Path,
    restored: RestoredModel,
    model: Any,
    datamodule: Any,
    split: str,
    batches: Iterable[Mapping[str, Any]],
    decoding: DecodingSettings | None,
    info: dict[str, Any],
    options: ReportOptions,
    path: Path,
    learning_curves: bool = True,
) -> tuple[dict[str, float], dict[str, Path]]:
    """Decode / classify `batches` of `split` with `model` (restored's, or an ensemble), then write the
    outputs into `out_dir`, the report and its plots (attention maps: restored's model; the training
    run's learning curves unless `learning_curves` is false: report.learning_curves)."""
    training_run = training_run_dir(restored, path)
    tokenizer = datamodule.src_tokenizer
    inputs = ReportInputs(
        info=info,
        model=restored.model,
        encode_source=lambda text: tokenizer.encode(text)[: datamodule.max_len],
        id_to_token=id_to_token(datamodule.tgt_tokenizer if restored.task == "translation" else tokenizer),
        source_id_to_token=id_to_token(tokenizer),
        curves=read_learning_curves(training_run) if training_run and learning_curves else {},
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
            directions=datamodule.directions(split) if hasattr(datamodule, "directions") else None,
            source_labels=labels.tokens if (labels := getattr(datamodule, "language_labels", None)) else (),
        )
        files = write_translation_outputs(out_dir, result, inputs, decoding=decoding)
        if result.n_best:
            files["nbest"] = write_n_best(out_dir / "nbest.txt", result.n_best)
        if decoding is not None and decoding.alignments:
            files["alignments"] = word_alignments.write_alignments(
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
