"""What `evaluate.py` checks and builds before it decodes: the checkpoint (or the average of a run's last
ones), the options that must fit its task, the datamodule with the checkpoint's tokenizer(s), the device
and the report options."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from data.datamodules import ClassificationDataModule, TranslationDataModule
from transformer.checkpoint import CheckpointError, average_checkpoints, load_checkpoint
from transformer.cli.arguments import ArgumentError, check_arguments
from transformer.cli.errors import ConfigError
from transformer.evaluation.reports import ReportOptions
from transformer.evaluation.restore import RestoredModel, last_checkpoints

log = logging.getLogger("evaluate")


DATAMODULES = {"translation": TranslationDataModule, "classification": ClassificationDataModule}


def load_checkpoints(cfg: DictConfig) -> tuple[dict[str, Any], list[Path]]:
    """The checkpoint to score (averaged over the last N of its run with `average_last`) and its file(s)."""
    path = Path(str(cfg.ckpt_path)).expanduser()
    n = cfg.get("average_last")
    if n is None:
        if path.is_dir():
            raise ConfigError(
                f"ckpt_path={path} is a directory: give a .ckpt file (e.g. {path}/checkpoints/last.ckpt), "
                "or add average_last=N to average its last N checkpoints"
            )
        return load_checkpoint(path), [path]
    directory = path.parent if path.is_file() else path
    paths = last_checkpoints(directory, n)
    log.info("Averaging %d checkpoints: %s", len(paths), ", ".join(p.name for p in paths))
    return average_checkpoints(paths), paths


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
                f"translate.input needs a translation checkpoint; {path} is a classification one"
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
    # The tokenizer(s) come from the checkpoint: no cache to read, nothing to train.
    settings.update(cache_dir=None, show_progress=show_progress)
    try:
        datamodule = cls(**settings)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"cannot build the {cls.__name__} of {path}: {err}") from None
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
