"""`model.init_from`'s weights, once the run's model is built: a masked-LM checkpoint's encoder copied into a
classifier, a classification or translation checkpoint's weights into the same task's model, each checked
against the run's tokenizers and model config (one `CheckpointError` naming the file), and what the run
records about where it started (`init_origin`). Its config and tokenizers were taken before the data was
read (`transformer.cli.init_from`); the checkpoint is read as `restore` reads one."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformer.checkpoint import CheckpointError, load_checkpoint, state_dict_mismatch
from transformer.evaluation.restore import (
    RestoredModel,
    is_masked_lm,
    model_weights,
    restore_model,
    saved_tokenizers,
    started_from,
)
from transformer.model import Seq2SeqTransformer, TransformerClassifier

__all__ = [
    "imported_note",
    "init_origin",
    "load_pretrained_classifier",
    "load_pretrained_encoder",
    "load_pretrained_translation",
]

_ENCODER_PREFIXES = ("src_embed.", "encoder.")  # what pretraining hands on to a classifier


def init_origin(path: str | Path) -> dict[str, Any]:
    """What a fine-tuning run records about its `model.init_from` checkpoint (`started_from`): its absolute
    path and what it was imported from (its own `imported_from`, or the one its own start recorded: a
    fine-tuned import fine-tuned again still names the original source). Reads the file memory-mapped:
    its weights were loaded already."""
    checkpoint = load_checkpoint(path, mmap=True)
    imported = checkpoint.get("imported_from")
    if not isinstance(imported, Mapping):
        imported = (started_from(checkpoint) or {}).get("imported_from")
    origin: dict[str, Any] = {"init_from": str(Path(path).resolve())}
    if isinstance(imported, Mapping):
        origin["imported_from"] = {k: v for k, v in imported.items() if k != "labels"}
    return origin


def imported_note(started: Mapping[str, Any] | None) -> str:
    """ " (imported from SOURCE)" for a log line when a run's start (`init_origin`) was imported, else ""."""
    imported = (started or {}).get("imported_from")
    return f" (imported from {imported.get('source')})" if imported else ""


def load_pretrained_encoder(
    model: TransformerClassifier, path: str | Path, tokenizers: Mapping[str, str] | None = None
) -> int:
    """Copy a `MaskedLMTask` checkpoint's encoder (`src_embed.*`, `encoder.*`) into `model`; returns the
    number of tensors copied. The rest of `model` (the head) keeps its initialization.

    `tokenizers` (the datamodule's `state_dict()["tokenizers"]`): when given, the checkpoint must have
    been pretrained with the same tokenizer, since token ids only mean something under it.
    """
    checkpoint = load_checkpoint(path)
    if not is_masked_lm(checkpoint.get("hyper_parameters")):
        raise CheckpointError(
            f"model.init_from={path} is not a masked-LM pretraining checkpoint (MaskedLMTask, "
            "`experiment=sst2_pretrain`); to continue a classification run use ckpt_path= instead"
        )
    return _copy_encoder(model, checkpoint, path, tokenizers)


def _copy_encoder(
    model: TransformerClassifier,
    checkpoint: Mapping[str, Any],
    path: str | Path,
    tokenizers: Mapping[str, str] | None,
) -> int:
    """`load_pretrained_encoder`'s copy, of the loaded masked-LM `checkpoint`."""
    if tokenizers is not None:
        saved = saved_tokenizers(checkpoint, "classification") or None
        if saved != tokenizers:
            raise CheckpointError(
                f"model.init_from={path} was pretrained with another tokenizer than this run's (compare "
                "data.vocab_size, data.min_frequency and the training split): token ids would not match"
            )
    weights = {k: v for k, v in model_weights(checkpoint).items() if k.startswith(_ENCODER_PREFIXES)}
    expected = {k: v for k, v in model.state_dict().items() if k.startswith(_ENCODER_PREFIXES)}
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    mismatched = [
        f"{key} {tuple(weights[key].shape)} vs {tuple(expected[key].shape)}"
        for key in sorted(set(expected) & set(weights))
        if weights[key].shape != expected[key].shape
    ]
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"model.init_from={path}: its encoder does not fit model.config (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, shapes checkpoint vs here {mismatched[:3]}); pretrain and "
            "fine-tune with the same d_model, n_heads, n_encoder_layers, d_ff, positional, norm_first"
        )
    model.load_state_dict(weights, strict=False)
    return len(weights)


def load_pretrained_classifier(
    model: TransformerClassifier, path: str | Path, tokenizers: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """`model.init_from` of a classification run: the encoder of a masked-LM checkpoint (the head stays
    new), or every weight of a classification checkpoint (trained here, or an imported BERT), its head
    too when it has as many classes (else the head stays new). Returns the number of tensors copied and
    what they were ("encoder tensors", or "tensors" saying whether the head was kept or is new).
    `tokenizers` as in `load_pretrained_translation`."""
    checkpoint = load_checkpoint(path)
    if is_masked_lm(checkpoint.get("hyper_parameters")):
        return _copy_encoder(model, checkpoint, path, tokenizers), "encoder tensors"
    restored = restore_model(checkpoint, path)
    if restored.task != "classification":
        raise CheckpointError(
            f"model.init_from={path} is a {restored.task} checkpoint: a classification run starts from a "
            "masked-LM (experiment=sst2_pretrain) or a classification checkpoint"
        )
    _check_tokenizers(restored, path, tokenizers)
    weights, expected = restored.model.state_dict(), model.state_dict()
    head_fits = all(
        key in weights and weights[key].shape == value.shape
        for key, value in expected.items()
        if key.startswith("head.")
    )
    if not head_fits:  # another number of classes: a new head
        weights = {k: v for k, v in weights.items() if not k.startswith("head.")}
    wanted = {k: v for k, v in expected.items() if head_fits or not k.startswith("head.")}
    _check_fits(wanted, weights, path)
    model.load_state_dict(weights, strict=head_fits)
    classes, theirs = model.head.out_features, restored.model.head.out_features
    if head_fits:
        return len(weights), f"tensors, the classification head kept ({classes} classes)"
    return len(
        weights
    ), f"tensors; the classification head is new ({classes} classes, the checkpoint's {theirs})"


def load_pretrained_translation(
    model: Seq2SeqTransformer, path: str | Path, tokenizers: Mapping[str, str] | None = None
) -> int:
    """Copy every weight of the translation checkpoint `path` (trained here, imported by aiayn-import, or a
    LoRA run's, merged) into `model`; returns the number of tensors copied. `tokenizers` (the datamodule's
    `state_dict()["tokenizers"]`): when given, they must be the checkpoint's, since token ids only mean
    something under them."""
    checkpoint = load_checkpoint(path)
    if is_masked_lm(checkpoint.get("hyper_parameters")):
        raise CheckpointError(
            f"model.init_from={path} is a masked-LM pretraining checkpoint: it starts a classifier "
            "(experiment=sst2), not a translation model"
        )
    restored = restore_model(checkpoint, path)
    if restored.task != "translation":
        raise CheckpointError(
            f"model.init_from={path} is a {restored.task} checkpoint: a translation run starts from a "
            "translation checkpoint (trained here, or imported with aiayn-import)"
        )
    _check_tokenizers(restored, path, tokenizers)
    weights = restored.model.state_dict()
    _check_fits(model.state_dict(), weights, path)
    model.load_state_dict(weights)
    return len(weights)


def _check_tokenizers(
    restored: RestoredModel, path: str | Path, tokenizers: Mapping[str, str] | None
) -> None:
    """`model.init_from`'s checkpoint must have the run's tokenizers (when given): token ids mean
    something only under them."""
    if tokenizers is not None and (restored.tokenizers or None) != tokenizers:
        raise CheckpointError(
            f"model.init_from={path} was trained with another tokenizer than this run's: token ids would "
            "not match (a fine-tuning run takes the checkpoint's tokenizer)"
        )


def _check_fits(expected: Mapping[str, Any], weights: Mapping[str, Any], path: str | Path) -> None:
    """`model.init_from`'s weights must have the names and shapes the run's model expects."""
    mismatch = state_dict_mismatch(expected, weights)
    if mismatch:
        raise CheckpointError(
            f"model.init_from={path}: its weights do not fit model.config ({mismatch}); a fine-tuning run "
            "takes the checkpoint's model config: leave model.config unset"
        )
