"""AdamW with the usual Transformer parameter groups: no weight decay on norms, biases and embeddings.

`adamw` has the signature of a Hydra partial target (`_partial_: true`): the task calls it with
the model; everything else (lr, betas, eps, weight_decay) comes from the config.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["adamw", "param_groups"]

# Modules whose weights are never decayed: decaying a norm's gain or an embedding row pulls it
# towards zero for no regularization benefit (rows of rare tokens decay on every step).
_NO_DECAY_MODULES = (nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices (decayed) and norms / biases / embeddings (`weight_decay` 0).

    A parameter shared by several modules (tied embedding and output projection) appears once,
    in the no-decay group as soon as one of its owners is an embedding.
    """
    no_decay_ids = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, _NO_DECAY_MODULES) or param.ndim < 2 or name.endswith("bias"):
                no_decay_ids.add(id(param))
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():  # deduplicated by torch, in registration order
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if id(param) in no_decay_ids else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _fused_supported(params: Sequence[torch.Tensor]) -> bool:
    """Fused AdamW runs on CUDA (and on CPU since torch 2.4) for floating-point parameters."""
    return all(p.is_floating_point() and p.device.type in ("cuda", "cpu", "xpu", "mps") for p in params)


def adamw(
    model: nn.Module,
    lr: float = 1e-3,
    betas: Sequence[float] = (0.9, 0.98),
    eps: float = 1e-9,
    weight_decay: float = 0.0,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """`torch.optim.AdamW` over `param_groups(model)`; defaults are the paper's Adam settings (section 5.3).

    `fused=None` picks the fused kernel when every parameter supports it.
    """
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    groups = param_groups(model, weight_decay)
    if fused is None:
        fused = _fused_supported([p for group in groups for p in group["params"]])
    return torch.optim.AdamW(
        groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=fused
    )
