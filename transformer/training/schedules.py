"""Learning-rate schedules, stepped once per optimizer step (Vaswani et al., 2017, section 5.3).

Each builder takes the optimizer first so that Hydra can pass it as a partial
(`_partial_: true`); the task calls it with the optimizer it built. The multipliers are small
callable objects, so `LambdaLR.state_dict()` stores their fields and a resumed run restores them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "CosineWithWarmup",
    "InverseSqrtWarmup",
    "LinearWithWarmup",
    "constant",
    "cosine_with_warmup",
    "inverse_sqrt",
    "linear_with_warmup",
]


def _check_steps(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class InverseSqrtWarmup:
    """Multiplier of the paper's schedule: linear warmup, then decay with the inverse square root of the step.

    With `d_model` set it is the paper's formula, d_model^-0.5 * min(step^-0.5, step * warmup^-1.5),
    to be multiplied by a base learning rate of about 1 (the "Noam" form). Without it the multiplier
    peaks at exactly 1 at `step == warmup_steps`, so the optimizer's `lr` is the peak learning rate.
    """

    warmup_steps: int
    d_model: int | None = None

    def __post_init__(self) -> None:
        _check_steps("warmup_steps", self.warmup_steps, 1)
        if self.d_model is not None:
            _check_steps("d_model", self.d_model, 1)

    def __call__(self, index: int) -> float:
        step = index + 1  # LambdaLR counts from 0; the paper's first update is step 1
        factor = min(step**-0.5, step * self.warmup_steps**-1.5)
        if self.d_model is None:
            return factor * self.warmup_steps**0.5  # = 1 at the peak
        return self.d_model**-0.5 * factor


@dataclass
class _WarmupThenDecay:
    """Multiplier: linear warmup to 1, then a decay (the subclass's `_decay` of the progress 0..1) down to
    `min_ratio` at `total_steps`, flat after."""

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        _check_steps("warmup_steps", self.warmup_steps, 0)
        _check_steps("total_steps", self.total_steps, 1)
        if self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"total_steps ({self.total_steps}) must be larger than warmup_steps ({self.warmup_steps})"
            )
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio must be in [0, 1], got {self.min_ratio!r}")

    def __call__(self, index: int) -> float:
        step = index + 1
        if step <= self.warmup_steps:
            return step / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self._decay(progress)

    def _decay(self, progress: float) -> float:
        raise NotImplementedError


@dataclass
class CosineWithWarmup(_WarmupThenDecay):
    """Multiplier: linear warmup to 1, then half a cosine down to `min_ratio` at `total_steps`, flat after."""

    def _decay(self, progress: float) -> float:
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class LinearWithWarmup(_WarmupThenDecay):
    """Multiplier: linear warmup to 1, then a straight line down to `min_ratio` at `total_steps`, flat
    after (the fine-tuning schedule of BERT and of transformers' `get_linear_schedule_with_warmup`)."""

    def _decay(self, progress: float) -> float:
        return 1.0 - (1.0 - self.min_ratio) * progress


def warmup_of(total_steps: int, warmup_steps: int | None, warmup_ratio: float | None) -> int:
    """`warmup_steps`, or `warmup_ratio` of `total_steps` when only that is given (rounded, at least 1 and
    less than `total_steps`)."""
    if warmup_steps is not None:
        return warmup_steps
    if warmup_ratio is None or isinstance(warmup_ratio, bool) or not 0.0 <= float(warmup_ratio) < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1) when warmup_steps is null, got {warmup_ratio!r}")
    if not warmup_ratio:
        return 0
    return min(max(1, round(float(warmup_ratio) * total_steps)), total_steps - 1)  # never the whole run


def linear_with_warmup(
    optimizer: Optimizer,
    total_steps: int,
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    min_ratio: float = 0.0,
) -> LambdaLR:
    """Linear warmup then linear decay to `min_ratio`; the warmup in steps, or as `warmup_ratio` of the
    run's optimizer steps. The tasks fill `total_steps` from the trainer when it is left out."""
    warmup = warmup_of(total_steps, warmup_steps, warmup_ratio)
    return LambdaLR(optimizer, LinearWithWarmup(warmup, total_steps, min_ratio))


def inverse_sqrt(optimizer: Optimizer, warmup_steps: int = 4000, d_model: int | None = None) -> LambdaLR:
    """The paper's schedule (section 5.3); see `InverseSqrtWarmup` for the two forms."""
    return LambdaLR(optimizer, InverseSqrtWarmup(warmup_steps, d_model))


def cosine_with_warmup(
    optimizer: Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup then cosine decay. The tasks fill `total_steps` from the trainer when it is left out."""
    return LambdaLR(optimizer, CosineWithWarmup(warmup_steps, total_steps, min_ratio))


@dataclass
class _Constant:
    def __call__(self, index: int) -> float:
        return 1.0


def constant(optimizer: Optimizer) -> LambdaLR:
    """The optimizer's `lr` throughout (as a scheduler, so the learning-rate monitor still logs it)."""
    return LambdaLR(optimizer, _Constant())
