"""A BERT-family directory (transformers' BertForSequenceClassification / BertModel, DistilBERT's) -> a
classification checkpoint of ours: `import_bert`, which `transformer.interop.import_hf.import_hf` calls for
their model_type; the config and weight mapping is `transformer.interop.bert`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from transformer.config import TransformerConfig
from transformer.encoder_only import TransformerClassifier
from transformer.interop.bert import (
    HEADED_CLASSES,
    POOLING,
    bert_refusal,
    config_from_bert,
    weights_from_bert,
)
from transformer.interop.source import ExportError, write_imported
from transformer.interop.weights import MAX_CLASSES, check_weights

__all__ = ["import_bert"]


def _architectures(config: Any) -> list[str]:
    return [name for name in (getattr(config, "architectures", None) or []) if isinstance(name, str)]


def _classifier(directory: Path, config: Any, num_classes: int | None) -> tuple[Any, int, bool]:
    """The transformers sequence classifier of `directory`: its own head when its weights have one, else
    (`num_classes` for a model without one: BertModel, BertForMaskedLM, ...) a new head initialised as
    transformers initialises one (seeded: the same weights on every import). Whether the head is there is
    read from the weights, not from `architectures` (older hub configs name none). Returns the model
    (eval mode), its class count and whether the head is new."""
    import transformers

    cls = getattr(transformers, HEADED_CLASSES[config.model_type])

    def load(**settings: Any) -> tuple[Any, list[str]]:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model, info = cls.from_pretrained(directory, output_loading_info=True, **settings)
        return model.eval(), sorted(info.get("missing_keys", []))

    model, missing = load()
    if not any(name.startswith("classifier.") for name in missing):
        labels = model.config.num_labels
        if labels < 2:
            raise _refusal(directory, f"num_labels={labels}: ours classifies into 2 or more classes")
        if num_classes is not None and num_classes != labels:
            raise _refusal(
                directory,
                f"it has a head for {labels} classes, not --num-classes {num_classes} (leave it out)",
            )
        if missing:
            raise _refusal(directory, f"its weights lack {', '.join(missing[:3])}")
        return model, labels, False
    if num_classes is None:
        found = ", ".join(_architectures(config)) or "none named"
        raise _refusal(
            directory,
            f"it has no classification head (architectures: {found}): pass --num-classes N for a new one",
        )
    if not 2 <= num_classes <= MAX_CLASSES:
        raise _refusal(directory, f"--num-classes {num_classes}: a classifier has 2 to {MAX_CLASSES} classes")
    model, missing = load(num_labels=num_classes)
    # the new head (and a pooler a BertModel was saved without) is initialised; nothing else may be
    lacking = [
        name for name in missing if not name.startswith(("classifier.", "pre_classifier.", "bert.pooler."))
    ]
    if lacking:
        raise _refusal(directory, f"its weights lack {', '.join(lacking[:3])}")
    return model, num_classes, True


def _refusal(directory: Path, reason: str) -> ExportError:
    return ExportError(f"cannot import {directory}: {reason}")


def import_bert(
    directory: Path,
    output: str | Path,
    config: Any,
    *,
    source: str | None,
    force: bool,
    num_classes: int | None,
) -> Path:
    """A BERT-family directory -> `output`/model.ckpt, a ClassificationTask checkpoint of ours:
    the weights (`weights_from_bert`), the model config, its WordPiece tokenizer (`data.wordpiece`), a
    data section for evaluation on SST-2 (`data.data_dir` names the files) and where it came from.
    Refusals name the setting, before anything is written."""
    import transformers

    refusal = bert_refusal(config)
    if refusal is not None:
        raise ExportError(f"cannot import {directory}: {refusal}")
    tokenizer = _wordpiece(directory, config)
    ours = _our_config(directory, config, tokenizer)
    headed = getattr(transformers, HEADED_CLASSES[config.model_type])
    # before allocating: sizes against the weights (a new head, and a pooler BertModel lacks, may be missing)
    check_weights(directory, headed, config, lacking_ok=("classifier.", "pre_classifier.", "bert.pooler."))
    theirs, num_classes, new_head = _classifier(directory, config, num_classes)
    model = _our_classifier(directory, config, ours, theirs, num_classes)
    labels = [str(theirs.config.id2label.get(i, i)) for i in range(num_classes)]
    provenance = {
        "source": source or str(directory),
        "architecture": HEADED_CLASSES[config.model_type],
        "architectures": _architectures(config),
        "new_head": new_head,
        "labels": labels,
        "revision": getattr(config, "_commit_hash", None),
        "transformers": transformers.__version__,
    }
    checkpoint = _classification_checkpoint(model, tokenizer, labels, provenance)
    return write_imported(checkpoint, output, force=force)


def _wordpiece(directory: Path, config: Any) -> Any:
    """The directory's WordPiece tokenizer (`data.wordpiece`), or an ExportError naming what is wrong."""
    from data.wordpiece import WordPieceTokenizer

    try:
        return WordPieceTokenizer.from_directory(directory, config.vocab_size)
    except FileNotFoundError as missing:
        raise ExportError(f"cannot import {directory}: no tokenizer ({missing})") from None
    except (ValueError, RuntimeError, OSError) as bad:
        raise ExportError(f"cannot import {directory}: its tokenizer files cannot be read ({bad})") from None


def _our_config(directory: Path, config: Any, tokenizer: Any) -> TransformerConfig:
    """Our model config for the BERT `config`, with the tokenizer's special ids."""
    try:
        return config_from_bert(
            config, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        )
    except ValueError as bad:  # a value our TransformerConfig refuses (heads not dividing the width)
        raise ExportError(f"cannot import {directory}: its config.json gives {bad}") from None


def _our_classifier(
    directory: Path, config: Any, ours: TransformerConfig, theirs: Any, num_classes: int
) -> TransformerClassifier:
    """Our classifier (eval mode) holding the weights of `theirs`, the transformers classifier."""
    pooling = POOLING[config.model_type]
    model = TransformerClassifier(ours, num_classes, pooling).eval()  # type: ignore[arg-type]
    try:
        model.load_state_dict(weights_from_bert(config.model_type, ours, theirs.state_dict()), strict=True)
    except KeyError as missing:
        raise ExportError(f"cannot import {directory}: it has no weight {missing}") from None
    return model


def _classification_checkpoint(
    model: TransformerClassifier, tokenizer: Any, labels: list[str], provenance: dict[str, Any]
) -> dict[str, Any]:
    """A ClassificationTask checkpoint of `model` as train.py writes one, with a data section for SST-2 and
    where it came from (`provenance`)."""
    tokenizers = {"joint": tokenizer.to_json()}
    ours = model.config
    return {
        "state_dict": {f"model.{name}": tensor for name, tensor in model.state_dict().items()},
        "hyper_parameters": {"config": ours.to_dict(), "num_classes": len(labels), "pooling": model.pooling},
        "tokenizers": tokenizers,  # read by programs (transformer.inference); the same object: stored once
        "class_names": labels,  # the head's classes in id order (the datamodule's come from its data)
        "ClassificationDataModule": {"tokenizers": tokenizers},
        "config": {
            "model": {"_target_": "transformer.training.ClassificationTask"},
            # SST-2 in the GLUE layout under data.data_dir, scored on dev as configs/data/sst2.yaml does
            # (GLUE's test split is unlabeled); other data: data.source=files, ...
            "data": {
                "_target_": "data.datamodules.ClassificationDataModule",
                "source": "sst2",
                "data_dir": None,
                "val_split": "dev",
                "test_split": "dev",
                "max_len": ours.max_len,
            },
        },
        "imported_from": provenance,
        "global_step": 0,
        "epoch": 0,
    }
