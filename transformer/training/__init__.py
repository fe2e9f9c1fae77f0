"""Training with Lightning: one LightningModule per task (translation, classification, masked-LM
pretraining) on a shared base, the optimizer and learning-rate schedules, the callbacks and checkpoint
I/O of a crash-safe run, and the rules for a run directory that already holds a run.

Imports the torch-only core (`transformer.*` at the top) and the scoring of `transformer.evaluation`
(validation computes the same numbers as evaluating a checkpoint); never the entry points, `cli` or
`export`. Nothing in `transformer.evaluation` imports this package: restoring and scoring a
checkpoint needs no Lightning.
"""

from transformer.training.classification import ClassificationTask
from transformer.training.masked_lm import MaskedLMTask
from transformer.training.translation import TranslationTask

__all__ = ["ClassificationTask", "MaskedLMTask", "TranslationTask"]
