"""Training with Lightning: one LightningModule per task (translation, classification, masked-LM
pretraining) on a shared base, the optimizer and learning-rate schedules, the callbacks and checkpoint
I/O of a crash-safe run, and the rules for a run directory that already holds a run.

Imports the torch-only core (`transformer.*` at the top) and the scoring of `transformer.evaluation`
(validation computes the same numbers as evaluating a checkpoint); never the entry points, `cli` or
`export`. Nothing in `transformer.evaluation` imports this package: restoring and scoring a
checkpoint needs no Lightning.

The tasks load on first use (PEP 562), so that a module of this package that needs only torch, such as
`compiling` (the compiled training step benchmarks/gpu/bench_gpu.py runs), imports on a bare GPU box that
has no sacreBLEU or torchmetrics.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformer.training.classification import ClassificationTask
    from transformer.training.masked_lm import MaskedLMTask
    from transformer.training.translation import TranslationTask

__all__ = ["ClassificationTask", "MaskedLMTask", "TranslationTask"]
_HOMES = {
    "ClassificationTask": "classification",
    "MaskedLMTask": "masked_lm",
    "TranslationTask": "translation",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
