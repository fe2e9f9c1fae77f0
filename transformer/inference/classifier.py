"""`Classifier`: a classification checkpoint (trained here, or a BERT imported by aiayn-import) that labels
texts in any program, in token-budget batches as `evaluate.py` scores them; and `load`, which picks the
class by the checkpoint's task."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from data.batching import ClassificationCollator
from transformer.checkpoint import CheckpointError, load_checkpoint
from transformer.evaluation.restore import last_checkpoints, task_of
from transformer.inference.batches import token_budget_batches
from transformer.inference.ctranslate2 import CTranslate2Translator
from transformer.inference.loading import as_paths, device_of, max_tokens_of
from transformer.inference.loading import load as load_checkpoints
from transformer.inference.outputs import InferenceError, Prediction
from transformer.inference.translator import Translator

__all__ = ["Classifier", "load"]


class Classifier:
    """Labels texts with a classification model and its checkpoint's tokenizer and class names. Call it
    from one thread at a time."""

    task = "classification"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        labels: Sequence[str],
        *,
        max_len: int,
        max_tokens: int,
        device: str | torch.device | None = None,
        paths: Sequence[Path] = (),
    ) -> None:
        classes = model.head.out_features
        if len(labels) != classes:
            raise InferenceError(f"{len(labels)} class names for a model of {classes} classes")
        self.model, self.tokenizer, self.labels = model, tokenizer, list(labels)
        self.max_len, self.max_tokens = max_len, max_tokens
        self.device = next(model.parameters()).device if device is None else device_of(device)
        self.paths = list(paths)

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, *, device: str | torch.device = "cpu", max_tokens: int | None = None
    ) -> Classifier:
        """The classification checkpoint at `path`; `max_tokens`: the batches' token budget (default: the
        checkpoint's `data.eval_max_tokens`)."""
        files = as_paths(path)
        if len(files) != 1:
            raise InferenceError(f"a classifier loads one checkpoint, got {len(files)}")
        target = device_of(device)
        loaded = load_checkpoints(files, "classification")
        labels = loaded.first.class_names
        if labels is None:
            raise InferenceError(f"checkpoint {files[0]} names no classes (no class_names): it cannot label")
        return cls(
            loaded.model.to(target).eval(),
            loaded.tokenizers["src"],
            labels,
            max_len=loaded.max_len,
            max_tokens=max_tokens_of(max_tokens, loaded.eval_max_tokens, loaded.max_len),
            device=target,
            paths=loaded.paths,
        )

    @property
    def num_parameters(self) -> int:
        return sum(parameter.numel() for parameter in self.model.parameters())

    @torch.no_grad()
    def predict(self, texts: Sequence[str]) -> list[Prediction]:
        """One `Prediction` per text, in input order: the most probable class (the first on a tie, as
        evaluate.py's predictions.tsv) and every class' probability."""
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise InferenceError(f"texts must be a list of strings, got {type(texts).__name__}")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InferenceError(f"segment {i}: the text must be a string, got {text!r}")
        ids = self.tokenizer.encode_batch(list(texts))
        collate = ClassificationCollator(getattr(self.tokenizer, "pad_id", self.model.config.pad_id))
        outputs: list[Prediction | None] = [None] * len(texts)
        self.model.eval()
        batches = token_budget_batches(ids, max_len=self.max_len, max_tokens=self.max_tokens, collate=collate)
        for batch in batches:
            probabilities = self.model(batch["src"].to(self.device)).float().softmax(dim=-1)  # (B, C)
            for index, row in zip(batch["id"].tolist(), probabilities.tolist()):
                best = max(range(len(row)), key=row.__getitem__)
                outputs[index] = Prediction(self.labels[best], dict(zip(self.labels, row)))
        return outputs  # type: ignore[return-value]  # every position filled: each text is in one batch


def load(
    paths: str | Path | Sequence[str | Path],
    *,
    device: str | torch.device = "cpu",
    backend: str = "torch",
    compute_type: str | None = None,
    **kwargs: Any,
) -> Translator | CTranslate2Translator | Classifier:
    """A `Translator` or a `Classifier`, as the (first) checkpoint's task says; `kwargs` go to its
    `from_checkpoint`. `backend="ctranslate2"` (translation only) gives a `CTranslate2Translator` instead,
    with CTranslate2's `compute_type` ("default", "int8", ...; torch has none)."""
    if backend not in ("torch", "ctranslate2"):
        raise InferenceError(f"backend={backend!r} is not a backend; expected torch or ctranslate2")
    if backend == "torch" and compute_type is not None:
        raise InferenceError(f"compute_type={compute_type!r} is CTranslate2's; the torch backend has none")
    files = as_paths(paths)
    try:
        probe = last_checkpoints(files[0], 1)[0] if files[0].is_dir() else files[0]  # average_last's run
        task = task_of(load_checkpoint(probe), probe)
    except (CheckpointError, ValueError) as err:
        raise InferenceError(str(err)) from None
    if task == "translation" and backend == "ctranslate2":
        return CTranslate2Translator.from_checkpoint(
            files, device=device, compute_type=compute_type or "default", **kwargs
        )
    if task == "translation":
        return Translator.from_checkpoint(files, device=device, **kwargs)
    if backend != "torch":
        raise InferenceError(
            f"backend={backend}: {files[0]} is a classification checkpoint, which runs on the torch backend"
        )
    if len(files) != 1:
        raise InferenceError(f"ensembles decode translations; {files[0]} is a classification checkpoint")
    return Classifier.from_checkpoint(files[0], device=device, **kwargs)
