"""What a run reports at its end: the final metrics as plain numbers, the newest checkpoint, the table
printed on stdout."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch

from transformer.evaluation.directions import direction_table


def last_checkpoint(trainer: L.Trainer) -> str | None:
    """The newest checkpoint: what a checkpoint callback without a monitor (or `save_last`) wrote."""
    for callback in trainer.checkpoint_callbacks:
        path = getattr(callback, "last_model_path", "") or (
            callback.best_model_path if getattr(callback, "monitor", None) is None else ""
        )
        if path:
            return path
    return None


def as_float(value: Any) -> float | None:
    """A metric (tensor or number) as a float; None for a missing or non-finite value."""
    if value is None:
        return None
    number = float(value.item() if isinstance(value, torch.Tensor) else value)
    return number if math.isfinite(number) else None


def floats(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    return {name: as_float(value) for name, value in metrics.items()}


def print_metrics(metrics: Mapping[str, Any], last_line: str) -> None:
    """The final metrics as a two-column table on stdout, then `last_line` (where the outputs are); a
    multilingual test split's scores first as one row per direction."""
    by_direction = direction_table({k: v for k, v in metrics.items() if isinstance(v, float)}, "test")
    if by_direction:
        print(by_direction)
    width = max((len(k) for k in metrics), default=0)
    for name, value in sorted(metrics.items()):
        print(f"{name:<{width}}  {number(value) if isinstance(value, float) else value}")
    print(last_line)
    sys.stdout.flush()


def number(value: float) -> str:
    """Four decimals, or three significant digits for a value too small for them (a learning rate:
    3.20e-04, not 0.0003; a loss near zero)."""
    return f"{value:.2e}" if 0 < abs(value) < 0.01 else f"{value:.4f}"
