"""Masked-LM pretraining (BERT) of a classifier's encoder on unlabelled text."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from transformer.config import TransformerConfig
from transformer.model import TransformerMaskedLM
from transformer.training.base import (
    OptimizerFactory,
    SchedulerFactory,
    TaskBase,
    plain,
)
from transformer.training.compiling import check_compile_mode

log = logging.getLogger(__name__)


class MaskedLMTask(TaskBase):
    """Masked-LM pretraining (BERT, Devlin et al., 2019) of an encoder on a classification dataset's text.

    The labels are ignored. Each step picks `mask_prob` of the tokens (never BOS/EOS/padding) and
    predicts them: 80% of the picked tokens are replaced by `mask_id` (`<unk>`: the tokenizers have no
    separate mask token), 10% by a random token, 10% are left as they are. Validation and test draw
    their masks from a fixed seed per batch, so their losses compare across epochs. Fine-tune the result
    with `ClassificationTask(init_from=<checkpoint>)` (`model.init_from=` in the configs).
    """

    best_metric = ("loss", "min")

    def __init__(
        self,
        config: Mapping[str, Any],
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        mask_prob: float = 0.15,
        mask_id: int = 3,
        compile: bool | str = False,
        activation_checkpointing: bool = False,
        low_precision_residual: bool | str = "auto",
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler, run_config)
        check_compile_mode(compile)
        config = plain(config)
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob!r}")
        self.save_hyperparameters(logger=False, ignore=["optimizer", "scheduler", "run_config"])
        self.model = TransformerMaskedLM(TransformerConfig.from_dict(config))
        self.pad_id = self.model.config.pad_id
        specials = (self.pad_id, self.model.config.bos_id, self.model.config.eos_id)
        if not 0 <= mask_id < self.model.config.src_vocab_size or mask_id in specials:
            raise ValueError(
                f"mask_id must be a token id below the vocabulary size {self.model.config.src_vocab_size} "
                f"other than padding, BOS and EOS {specials}, got {mask_id!r}"
            )
        self.metrics = nn.ModuleDict(
            {f"{stage}_{name}": MeanMetric() for stage in ("val", "test") for name in ("loss", "acc")}
        )

    def mask_tokens(self, src: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """src (B, S) -> (masked src (B, S), picked positions (B, S) bool)."""
        config = self.model.config
        # the special ids come first in the vocabulary; random replacements are ordinary tokens
        first_word = max(config.pad_id, config.bos_id, config.eos_id, self.hparams.mask_id) + 1
        maskable = src.ne(config.pad_id) & src.ne(config.bos_id) & src.ne(config.eos_id)  # (B, S)
        draw = torch.rand(src.shape, device=src.device, generator=generator)  # (B, S)
        picked = maskable & (draw < self.hparams.mask_prob)
        # the same draw, rescaled within the picked tokens, splits them 80 / 10 / 10
        share = draw / self.hparams.mask_prob  # (B, S) in [0, 1) where picked
        random_ids = torch.randint(
            first_word, config.src_vocab_size, src.shape, device=src.device, generator=generator
        )
        masked = torch.where(picked & (share < 0.8), torch.full_like(src, self.hparams.mask_id), src)
        masked = torch.where(picked & (share >= 0.8) & (share < 0.9), random_ids, masked)
        return masked, picked

    def _loss(
        self, batch: Mapping[str, Tensor], generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor, int]:
        """(mean cross entropy over the picked tokens, their accuracy, how many were picked)."""
        src = batch["src"]
        masked, picked = self.mask_tokens(src, generator)
        logits = self.model(masked, picked)  # (N, V)
        gold = src[picked]  # (N,)
        n = gold.numel()
        if n == 0:  # nothing picked in this (tiny) batch: the empty logits sum to a zero loss, zero gradients
            zero = logits.float().sum()
            return zero, zero.detach(), 0
        loss = F.cross_entropy(logits.float(), gold)
        acc = logits.argmax(dim=-1).eq(gold).float().mean()
        return loss, acc, n

    def forward(self, src: Tensor, positions: Tensor) -> Tensor:
        """src (B, S) (masked), positions (B, S) bool -> logits (N, V) at the N picked positions."""
        return self.model(src, positions)

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        loss, acc, _ = self._loss(batch)
        B = batch["src"].size(0)
        self._log_training_loss(loss, B)
        self.log("train/acc", acc, batch_size=B)
        self._log_throughput(batch["src"].ne(self.pad_id).sum(), batch["src"].numel(), B)
        return loss

    def _eval_step(self, stage: str, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        if self._repeated_share():
            return
        # seeded by the batch's place in the whole split (under DDP rank r evaluates batches r, r + N, ...):
        # the same masks as one process
        seed = batch_idx * self.trainer.world_size + self.trainer.global_rank
        generator = torch.Generator(device=batch["src"].device).manual_seed(seed)
        loss, acc, n = self._loss(batch, generator)
        if n:
            self.metrics[f"{stage}_loss"].update(loss.detach(), n)
            self.metrics[f"{stage}_acc"].update(acc, n)

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        self._eval_step("val", batch, batch_idx)

    def test_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        self._eval_step("test", batch, batch_idx)

    def _log_epoch(self, stage: str) -> dict[str, float]:
        return self._log_epoch_metrics(stage, ("loss", "acc"), prog_bar=("loss", "acc"))

    def on_validation_epoch_end(self) -> None:
        self._log_best(self._log_epoch("val")["loss"])

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")
