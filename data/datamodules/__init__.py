"""LightningDataModules tying sources, BPE tokenizers and token-budget batching together, one per task.

`tokenized` takes raw splits to cached token ids, `base` serves them as token-budget batches (with BPE-dropout
and the resumable sampler state), `translation` and `classification` fill in what differs per task. Configs
and checkpoints name the task classes as `data.datamodules.TranslationDataModule` and
`data.datamodules.ClassificationDataModule`.
"""

from data.datamodules.base import TokenBudgetDataModule
from data.datamodules.classification import ClassificationDataModule
from data.datamodules.settings import TOKENIZER_SAMPLE_SIZE, TokenizedSettings
from data.datamodules.tokenized import TokenizedDataModule
from data.datamodules.translation import TranslationDataModule

__all__ = [
    "TOKENIZER_SAMPLE_SIZE",
    "ClassificationDataModule",
    "TokenBudgetDataModule",
    "TokenizedDataModule",
    "TokenizedSettings",
    "TranslationDataModule",
]
