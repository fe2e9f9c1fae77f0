"""A trained model back from a checkpoint dict: which task it is, its weights, its saved settings.

Only plain data is read (the dict comes from `transformer.checkpoint.load_checkpoint`); no class named
inside the checkpoint is ever imported or called, so a checkpoint can describe a model but not run code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import nn

from transformer.checkpoint import CheckpointError, load_checkpoint, state_dict_mismatch, strip_compile_prefix
from transformer.config import TransformerConfig
from transformer.lora import FinetuneSettings, LoraSettings, add_lora, merge_lora
from transformer.model import Seq2SeqTransformer, TransformerClassifier
from transformer.search.decoding import DecodingSettings

__all__ = [
    "DATAMODULES",
    "TASKS",
    "RestoredModel",
    "checkpoint_decoding",
    "finetune_settings",
    "is_masked_lm",
    "last_checkpoints",
    "lora_settings",
    "model_weights",
    "restore_model",
    "saved_class_names",
    "saved_language_labels",
    "saved_tokenizers",
    "task_of",
    "with_stable_keys",
]

TaskKind = Literal["translation", "classification"]
# The task's LightningModule class and the datamodule class whose state Lightning saves with it.
TASKS: dict[str, TaskKind] = {"TranslationTask": "translation", "ClassificationTask": "classification"}
DATAMODULES: dict[TaskKind, str] = {
    "translation": "TranslationDataModule",
    "classification": "ClassificationDataModule",
}
# The checkpoint's own keys for what a program needs besides the weights, whatever wrote it (train.py's
# tasks, aiayn-import): the tokenizer JSON(s) by side ("joint", or "src" and "tgt") and a classifier's class
# names in id order, readable without knowing the datamodule class. Older checkpoints hold them only in the
# datamodule's state (`DATAMODULES`); `saved_tokenizers` / `saved_class_names` read either.
TOKENIZERS_KEY, CLASS_NAMES_KEY = "tokenizers", "class_names"
# a multilingual model's target-language labels (`data.labels.LanguageLabels.to_state()`; evaluation may not
# import data/, so `saved_language_labels` hands the raw state on); absent for a bilingual model
LANGUAGE_LABELS_KEY = "language_labels"
STARTED_FROM_KEY = "started_from"  # a fine-tuning run's `model.init_from` and its provenance (`init_origin`)
_MODEL_PREFIX = "model."  # the tasks hold their network as `self.model`


@dataclass
class RestoredModel:
    """A network rebuilt from a checkpoint, in eval mode on the CPU, plus what evaluation needs from it."""

    task: TaskKind
    model: nn.Module
    hparams: dict[str, Any]  # the task's saved hyperparameters (plain data)
    run_config: dict[str, Any]  # the resolved training config ({} for checkpoints without one)
    datamodule_state: dict[str, Any] = field(default_factory=dict)  # tokenizer JSON(s), class names
    global_step: int | None = None
    epoch: int | None = None
    tokenizers: dict[str, str] = field(default_factory=dict)  # `saved_tokenizers`: JSON by side
    class_names: list[str] | None = None  # `saved_class_names` (classification)
    language_labels: dict[str, Any] | None = None  # `saved_language_labels` (a multilingual model)
    imported_from: dict[str, Any] | None = None  # aiayn-import's provenance (None: trained here)
    # a fine-tuning run's start (`model.init_from`): {"init_from": absolute path, "imported_from": ...}
    started_from: dict[str, Any] | None = None

    @property
    def origin(self) -> dict[str, Any] | None:
        """What the weights were imported from: this checkpoint's `imported_from`, else that of the
        checkpoint its fine-tuning run started from (None: trained here from scratch)."""
        return self.imported_from or (self.started_from or {}).get("imported_from")

    def __post_init__(self) -> None:
        # built by hand from a datamodule state alone (tests, older callers): read it as a checkpoint's
        if not self.tokenizers:
            self.tokenizers = saved_tokenizers({DATAMODULES[self.task]: self.datamodule_state}, self.task)
        if self.class_names is None and self.task == "classification":
            self.class_names = saved_class_names({DATAMODULES[self.task]: self.datamodule_state})


def model_weights(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The task's network weights (`model.*`), named as the network itself names them."""
    return {
        key.removeprefix(_MODEL_PREFIX): value
        for key, value in strip_compile_prefix(checkpoint["state_dict"]).items()
        if key.startswith(_MODEL_PREFIX)
    }


def is_masked_lm(hparams: Any) -> bool:
    """Whether a checkpoint's hyperparameters are a `MaskedLMTask`'s (pretraining, no classifier head)."""
    return isinstance(hparams, Mapping) and "mask_prob" in hparams


def _hparams(checkpoint: Mapping[str, Any], path: str | Path) -> Mapping[str, Any]:
    hparams = checkpoint.get("hyper_parameters")
    if not isinstance(hparams, Mapping) or not isinstance(hparams.get("config"), Mapping):
        raise CheckpointError(
            f"checkpoint {path} has no task hyperparameters with a model `config`: "
            "it was not written by train.py (TranslationTask / ClassificationTask)"
        )
    return hparams


def task_of(checkpoint: Mapping[str, Any], path: str | Path = "<checkpoint>") -> TaskKind:
    """The task of `checkpoint`: "translation" or "classification".

    Hyperparameters, weights, config and datamodule state must all tell the same story (a mixed-up
    or hand-edited checkpoint is refused).
    """
    hparams = _hparams(checkpoint, path)
    if is_masked_lm(hparams):
        raise CheckpointError(
            f"checkpoint {path} is a masked-LM pretraining checkpoint (MaskedLMTask): it has no classifier "
            "to evaluate; fine-tune it first (`model.init_from=` of a classification run)"
        )
    kind: TaskKind = "classification" if "num_classes" in hparams else "translation"
    evidence = {"hyperparameters": kind}
    keys = checkpoint["state_dict"].keys()
    if any(k.startswith(f"{_MODEL_PREFIX}head.") for k in keys):
        evidence["weights"] = "classification"
    elif any(k.startswith(f"{_MODEL_PREFIX}decoder.") for k in keys):
        evidence["weights"] = "translation"
    config = checkpoint.get("config")
    target = config.get("model", {}).get("_target_") if isinstance(config, Mapping) else None
    if isinstance(target, str) and target.rsplit(".", 1)[-1] in TASKS:
        evidence["config model._target_"] = TASKS[target.rsplit(".", 1)[-1]]
    saved_datamodules = [name for name in DATAMODULES.values() if name in checkpoint]
    for name in saved_datamodules:
        evidence[f"{name} state"] = next(k for k, v in DATAMODULES.items() if v == name)
    if len(set(evidence.values())) > 1:
        story = ", ".join(f"{source} says {value}" for source, value in evidence.items())
        raise CheckpointError(f"checkpoint {path} is inconsistent: {story}")
    return kind


def checkpoint_decoding(hparams: Mapping[str, Any]) -> DecodingSettings:
    """The decoding settings a translation task's test step used: `test_decoding` over `decoding`."""
    return DecodingSettings.from_values(hparams.get("test_decoding"), hparams.get("decoding"))


def finetune_settings(hparams: Mapping[str, Any], path: str | Path = "<checkpoint>") -> FinetuneSettings:
    """The `finetune` settings a run was trained with (frozen modules, LoRA adapters); a plain checkpoint's
    are the defaults."""
    try:
        return FinetuneSettings.from_values(hparams.get("finetune"))
    except ValueError as err:
        raise CheckpointError(f"checkpoint {path}: its {err}") from None


def lora_settings(hparams: Mapping[str, Any], path: str | Path = "<checkpoint>") -> LoraSettings | None:
    """The LoRA adapters a fine-tuning run trained (its `finetune.lora`), None for a plain checkpoint."""
    return finetune_settings(hparams, path).lora


def restore_model(checkpoint: Mapping[str, Any], path: str | Path = "<checkpoint>") -> RestoredModel:
    """Rebuild the task's network from `checkpoint` (hyperparameters + weights), in eval mode. The LoRA
    adapters of a LoRA fine-tuning run are merged into the weights they update: a plain network."""
    kind = task_of(checkpoint, path)
    hparams = dict(_hparams(checkpoint, path))
    try:
        config = TransformerConfig.from_dict(hparams["config"])
        if kind == "translation":
            model: nn.Module = Seq2SeqTransformer(config)
        else:
            model = TransformerClassifier(config, hparams["num_classes"], hparams.get("pooling", "cls"))
        finetune = finetune_settings(hparams, path)
        lora = finetune.lora
        if lora is not None:  # the layout it was trained and saved in: base weights and adapters
            add_lora(model, lora, skip=finetune.frozen_modules)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path}: its model config cannot be built: {err}") from None
    weights = model_weights(checkpoint)
    expected = model.state_dict()
    mismatch = state_dict_mismatch(expected, weights)
    if mismatch:
        raise CheckpointError(f"checkpoint {path}: weights do not match its model config ({mismatch})")
    model.load_state_dict(weights)
    if lora is not None:
        merge_lora(model)
    model.eval()
    config_dict = checkpoint.get("config")
    imported = checkpoint.get("imported_from")
    return RestoredModel(
        task=kind,
        model=model,
        hparams=hparams,
        run_config=dict(config_dict) if isinstance(config_dict, Mapping) else {},
        datamodule_state=dict(checkpoint.get(DATAMODULES[kind]) or {}),
        global_step=checkpoint.get("global_step"),
        epoch=checkpoint.get("epoch"),
        tokenizers=saved_tokenizers(checkpoint, kind),
        class_names=saved_class_names(checkpoint, kind) if kind == "classification" else None,
        language_labels=saved_language_labels(checkpoint),
        imported_from=dict(imported) if isinstance(imported, Mapping) else None,
        started_from=started_from(checkpoint),
    )


def started_from(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
    """A fine-tuning checkpoint's `started_from` key (written by the training task): the `model.init_from`
    it started from and what that one was imported from."""
    value = checkpoint.get(STARTED_FROM_KEY)
    return dict(value) if isinstance(value, Mapping) else None


def saved_tokenizers(checkpoint: Mapping[str, Any], kind: TaskKind) -> dict[str, str]:
    """The tokenizer JSON(s) of `checkpoint` by side ("joint", or "src" and "tgt"; {} if it has none). The
    writers put the same object under the checkpoint's `tokenizers` key and in its datamodule's state; where
    a checkpoint was edited so that they differ, the datamodule state wins (what a resumed run and
    evaluate.py's datamodule load); a checkpoint without that state is read from the key alone. Plain
    strings: `data.tokenization.tokenizer_from_json` turns one into a tokenizer."""
    for saved in (
        (checkpoint.get(DATAMODULES[kind]) or {}).get("tokenizers"),
        checkpoint.get(TOKENIZERS_KEY),
    ):
        if isinstance(saved, Mapping) and saved:
            return dict(saved)
    return {}


def saved_language_labels(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
    """A multilingual checkpoint's target-language labels as written (its top-level `language_labels`
    key: `data.labels.LanguageLabels.to_state()`), None for a bilingual one; `LanguageLabels.from_state`
    turns it into labels."""
    state = checkpoint.get(LANGUAGE_LABELS_KEY)
    return dict(state) if isinstance(state, Mapping) and state else None


def saved_class_names(checkpoint: Mapping[str, Any], kind: TaskKind = "classification") -> list[str] | None:
    """A classifier's class names in id order: its datamodule's state (as `saved_tokenizers`), else its
    `class_names` key (an imported BERT's: its id2label), else (a BERT imported before that key) the labels
    its provenance records; None when nothing names them."""
    for names in (
        (checkpoint.get(DATAMODULES[kind]) or {}).get("class_names"),
        checkpoint.get(CLASS_NAMES_KEY),
        (checkpoint.get("imported_from") or {}).get("labels"),
    ):
        if isinstance(names, (list, tuple)) and names:
            return [str(name) for name in names]
    return None


def with_stable_keys(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """`checkpoint` with its datamodule state's tokenizers (and class names) also under the checkpoint's own
    keys, which programs read without knowing the datamodule class (`saved_tokenizers`). The same objects
    are referenced, not copied: pickle stores them once, so the file does not grow."""
    for name in DATAMODULES.values():
        state = checkpoint.get(name)
        if not isinstance(state, Mapping):
            continue
        if state.get("tokenizers"):
            checkpoint[TOKENIZERS_KEY] = state["tokenizers"]
        if state.get("class_names"):
            checkpoint[CLASS_NAMES_KEY] = state["class_names"]
    return checkpoint


def last_checkpoints(directory: str | Path, n: int) -> list[Path]:
    """The `n` checkpoints of a run with the highest global steps, oldest first.

    `directory` is a run directory (its `checkpoints/` is searched) or a checkpoint directory. The
    order comes from the global step stored in each file, not from names or times. Files of the same
    step (`last.ckpt` is a copy of the newest epoch checkpoint) count once; the named one is kept.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"average_last must be an integer >= 1, got {n!r}")
    directory = Path(directory)
    if (directory / "checkpoints").is_dir():
        directory = directory / "checkpoints"
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    by_step: dict[int, Path] = {}
    for path in sorted(directory.glob("*.ckpt"), key=lambda p: (p.name.startswith("last"), p.name)):
        step = load_checkpoint(path).get("global_step")
        if not isinstance(step, int):
            raise CheckpointError(f"checkpoint {path} has no global_step: cannot order it among the others")
        by_step.setdefault(step, path)
    if len(by_step) < n:
        found = ", ".join(f"{p.name} (step {s})" for s, p in sorted(by_step.items())) or "none"
        raise CheckpointError(
            f"average_last={n} needs {n} checkpoints of different steps in {directory}; found {found} "
            "(keep more with callbacks.model_checkpoint.save_top_k=-1 when training)"
        )
    return [by_step[step] for step in sorted(by_step)[-n:]]
