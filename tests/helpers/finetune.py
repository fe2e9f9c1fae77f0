"""What the fine-tuning tests (LoRA, freeze, init_from) share: a tiny task under AdamW, a batch of the copy
task, a model's logits on it, adapters given random values, and the sizes of tests/helpers/tasks.py's TINY."""

from __future__ import annotations

import functools

import torch

from tests.helpers.tasks import TINY, CopyData
from transformer.training import ClassificationTask, TranslationTask
from transformer.training.optim import adamw

D, D_FF, RANK = TINY["d_model"], TINY["d_ff"], 4


def tiny_task(cls=TranslationTask, **kwargs):
    """A TINY task of `cls` (a classifier: two classes, no decoder) under AdamW at 1e-2."""
    extra = {"num_classes": 2} if cls is ClassificationTask else {}
    config = {**TINY, "n_decoder_layers": 0} if cls is ClassificationTask else TINY
    return cls(config, optimizer=functools.partial(adamw, lr=1e-2), **extra, **kwargs)


def copy_batch() -> dict[str, torch.Tensor]:
    """The first validation batch of the copy task."""
    return next(iter(CopyData().val_dataloader()))


def logits_of(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`model`'s logits on `batch` in eval mode, without gradients."""
    model.eval()
    with torch.no_grad():
        return model(batch["src"], batch["tgt_in"])


def randomize_adapters(model: torch.nn.Module) -> None:
    """LoRA's B matrices (zero at the start) drawn from N(0, 0.5): adapters that change the outputs."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
