"""Fine-tuning (`finetune`, configs/finetune/): the parts of the model that stay frozen and the LoRA adapters
(`transformer.lora`), applied to a task's network once its starting weights (`model.init_from`) are in. The
section itself has one reader, `transformer.lora.FinetuneSettings` (train.py, restore, aiayn-lora)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from transformer.lora import FinetuneSettings, add_lora, is_under

__all__ = ["apply_finetune", "frozen_parts", "parameter_counts"]

log = logging.getLogger(__name__)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters of `model`, each shared tensor (tied embeddings) counted once."""
    parameters = list(model.parameters())  # deduplicated by torch
    return sum(p.numel() for p in parameters if p.requires_grad), sum(p.numel() for p in parameters)


def frozen_parts(model: nn.Module) -> str:
    """What is frozen and what trains, by the model's top modules with their parameter counts (a shared
    tensor counted under the first module holding it); a tensor several modules share (tied embeddings:
    the source and target embeddings and the output projection are one matrix) is named with all of them,
    since freezing it in one freezes it in every other."""
    holders: dict[int, list[str]] = {}
    tensors: dict[int, nn.Parameter] = {}
    frozen, trainable = [], []
    for name, child in model.named_children():
        own = [p for p in child.parameters() if id(p) not in holders]
        for p in child.parameters():
            holders.setdefault(id(p), []).append(name)
            tensors[id(p)] = p
        n_frozen = sum(p.numel() for p in own if not p.requires_grad)
        n_trainable = sum(p.numel() for p in own if p.requires_grad)
        if n_frozen:
            frozen.append(f"{name} {n_frozen}")
        if n_trainable:
            trainable.append(f"{name} {n_trainable}")
    shared = [
        f"one {tuple(tensors[key].shape)} tensor in {', '.join(names)} "
        f"({'trainable' if tensors[key].requires_grad else 'frozen'} in all of them)"
        for key, names in holders.items()
        if len(names) > 1
    ]
    text = f"frozen: {', '.join(frozen) or 'nothing'}; trainable: {', '.join(trainable) or 'nothing'}"
    return text + (f"; tied: {'; '.join(shared)}" if shared else "")


def apply_finetune(model: nn.Module, settings: FinetuneSettings, trainable: Sequence[str] = ()) -> str:
    """Freeze `settings.freeze`'s modules; with LoRA, add the adapters (not in frozen modules) and freeze
    every other weight but the modules `trainable` (a classifier's new head). Returns the log line
    with the trainable parameter count."""
    frozen = settings.frozen_modules
    for path, module in model.named_modules():
        if is_under(path, frozen):
            for parameter in module.parameters():  # a tied embedding is frozen wherever else it is used
                parameter.requires_grad_(False)
    if settings.lora is None:
        n_trainable, n_all = parameter_counts(model)
        frozen_part = f"finetune.freeze={settings.freeze}"
        return (
            f"Fine-tuning ({frozen_part}): {n_trainable} trainable of {n_all} parameters; "
            f"{frozen_parts(model)}"
        )
    model.requires_grad_(False)
    names = add_lora(model, settings.lora, frozen)  # its A and B are new parameters, trainable
    for path, module in model.named_modules():
        if is_under(path, trainable):
            module.requires_grad_(True)
    n_trainable, n_all = parameter_counts(model)
    lora = settings.lora
    return (
        f"LoRA: {n_trainable} trainable of {n_all} parameters (rank {lora.rank}, alpha {lora.alpha}, "
        f"{len(names)} weights: {', '.join(lora.targets)})"
    )
