"""Sentence classification with an encoder-only Transformer: cross entropy, accuracy, macro-F1, and the
regularizers of the SST-2 recipe (token dropout, R-Drop, adversarial embeddings)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from transformer.config import TransformerConfig
from transformer.encoder_only import Pooling
from transformer.evaluation.init_from import imported_note, init_origin, load_pretrained_classifier
from transformer.losses import symmetric_kl
from transformer.model import TransformerClassifier
from transformer.training.base import (
    OptimizerFactory,
    SchedulerFactory,
    TaskBase,
    plain,
)
from transformer.training.compiling import check_compile_mode

log = logging.getLogger(__name__)


class ClassificationTask(TaskBase):
    """Sentence classification with an encoder-only Transformer: cross entropy, accuracy, macro-F1."""

    best_metric = ("acc", "max")
    trainable_modules = ("head",)  # new for the task: trained under LoRA too

    def __init__(
        self,
        config: Mapping[str, Any],
        num_classes: int,
        pooling: Pooling = "cls",
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        label_smoothing: float = 0.0,
        token_dropout: float = 0.0,
        rdrop: float = 0.0,
        adversarial: float = 0.0,
        init_from: str | None = None,
        finetune: Mapping[str, Any] | None = None,
        compile: bool | str = False,
        activation_checkpointing: bool = False,
        low_precision_residual: bool | str = "auto",
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler, run_config)
        check_compile_mode(compile)
        config = plain(config)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
        if not 0.0 <= token_dropout < 1.0:
            raise ValueError(f"token_dropout must be in [0, 1), got {token_dropout!r}")
        if rdrop < 0.0:
            raise ValueError(f"rdrop must be >= 0, got {rdrop!r}")
        if adversarial < 0.0:
            raise ValueError(f"adversarial must be >= 0, got {adversarial!r}")
        self.save_hyperparameters(logger=False, ignore=["optimizer", "scheduler", "run_config"])
        self.model = TransformerClassifier(TransformerConfig.from_dict(config), num_classes, pooling)
        self._take_finetune(finetune)
        self.pad_id = self.model.config.pad_id
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_{name}": metric
                for stage in ("train", "val", "test")
                for name, metric in (
                    ("acc", MulticlassAccuracy(num_classes, average="micro")),
                    ("f1", MulticlassF1Score(num_classes, average="macro")),
                    ("loss", MeanMetric()),
                )
            }
        )

    def load_init_from(self, tokenizers: Mapping[str, str] | None = None) -> int:
        """Copy the encoder (embeddings + layers) of the `MaskedLMTask` checkpoint `init_from` into the
        model, the head keeping its initialization; or every weight of a classification checkpoint
        (trained here or an imported BERT, whose config and tokenizer train.py gave the run), its head too
        when it has as many classes. `tokenizers` (the datamodule's `state_dict()` entry) must be the
        checkpoint's. `train.py` calls this before a fresh fit, not on resume. Returns the number of
        tensors copied (0 without `init_from`)."""
        if not self.hparams.init_from:
            return 0
        loaded, what = load_pretrained_classifier(self.model, self.hparams.init_from, tokenizers)
        self.started_from = init_origin(self.hparams.init_from)
        note = imported_note(self.started_from)
        log.info("Initialized %d %s from %s%s", loaded, what, self.hparams.init_from, note)
        return loaded

    def forward(self, src: Tensor) -> Tensor:
        """src (B, S) -> logits (B, C)."""
        return self.model(src)

    def drop_tokens(self, src: Tensor) -> Tensor:
        """Word dropout (Iyyer et al., 2015): in training, each token other than BOS/EOS becomes padding
        with probability `token_dropout`, so attention and pooling skip it; src (B, S) -> (B, S)."""
        p = self.hparams.token_dropout
        if not self.training or p == 0.0:
            return src
        config = self.model.config
        droppable = src.ne(config.pad_id) & src.ne(config.bos_id) & src.ne(config.eos_id)  # (B, S)
        drop = droppable & (torch.rand(src.shape, device=src.device) < p)
        return src.masked_fill(drop, config.pad_id)

    def _logits(self, src: Tensor, perturbation: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """src (B, S) -> logits (B, C) in fp32 and the token embeddings (B, S, D) that the model looked
        up (before its sqrt(D) scaling), with `perturbation` (B, S, D) added to them. The forward hook
        lives only for this call, and `_step` calls this only for adversarial training steps, so plain
        passes run without it."""
        looked_up = []

        def perturb(module: nn.Module, args: Any, embeddings: Tensor) -> Tensor:
            if torch.is_grad_enabled() and not embeddings.requires_grad:
                # a frozen embedding (finetune.freeze, LoRA): the perturbation still needs the loss
                # gradient with respect to the looked-up vectors
                embeddings = embeddings.detach().requires_grad_()
            if perturbation is not None:
                embeddings = embeddings + perturbation
            looked_up.append(embeddings)
            return embeddings

        handle = self.model.src_embed.embedding.register_forward_hook(perturb)
        try:
            logits = self.model(src).float()
        finally:
            handle.remove()
        return logits, looked_up[0]

    def adversarial_perturbation(self, loss: Tensor, embeddings: Tensor, src: Tensor) -> Tensor:
        """The fast-gradient perturbation of Miyato et al. (2017): per sentence, the direction of the
        loss gradient w.r.t. the token embeddings (B, S, D), scaled to `adversarial` times the norm of
        the sentence's own embeddings (padding excluded), so its size follows the embeddings' scale.
        A constant: no gradient flows through it."""
        (grad,) = torch.autograd.grad(loss, embeddings, retain_graph=True)  # (B, S, D)
        keep = src.ne(self.pad_id).unsqueeze(-1)  # (B, S, 1)
        grad = grad.float().masked_fill(~keep, 0.0)
        size = embeddings.detach().float().masked_fill(~keep, 0.0).norm(dim=(1, 2), keepdim=True)  # (B, 1, 1)
        direction = grad / grad.norm(dim=(1, 2), keepdim=True).clamp(min=1e-12)
        return (self.hparams.adversarial * size * direction).to(embeddings.dtype)

    def _step(self, stage: str, batch: Mapping[str, Tensor]) -> Tensor:
        src, labels = batch["src"], batch["label"]  # (B, S), (B,)
        smoothing = self.hparams.label_smoothing
        training = stage == "train"
        # R-Drop (Liang et al., 2021) in training: the batch twice through the model, so with two dropout
        # masks; both copies' cross entropy plus `rdrop` times the symmetric KL between their predictions
        copies = 2 if training and self.hparams.rdrop > 0.0 else 1
        adversarial = training and self.hparams.adversarial > 0.0
        src = self.drop_tokens(src.repeat(copies, 1))  # (copies * B, S)
        targets = labels.repeat(copies)  # (copies * B,)
        if adversarial:
            logits, embeddings = self._logits(src)  # (copies * B, C), (copies * B, S, D)
        else:
            logits = self.model(src).float()  # (copies * B, C)
        loss = F.cross_entropy(logits, targets, label_smoothing=smoothing)
        if copies == 2:
            logits, other = logits.chunk(2)  # (B, C) each
            loss = loss + self.hparams.rdrop * symmetric_kl(logits, other)
        if adversarial:
            # adversarial training (Miyato et al., 2017): also the cross entropy of the same tokens with
            # their embeddings moved in the direction that raises the loss most (a second forward pass)
            perturbation = self.adversarial_perturbation(loss, embeddings, src)
            adversarial_logits, _ = self._logits(src, perturbation)
            loss = loss + F.cross_entropy(adversarial_logits, targets, label_smoothing=smoothing)
        preds = logits.argmax(dim=-1)  # (B,)
        self.metrics[f"{stage}_acc"].update(preds, labels)
        self.metrics[f"{stage}_f1"].update(preds, labels)
        self.metrics[f"{stage}_loss"].update(loss.detach(), labels.numel())
        return loss

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._step("train", batch)
        B = batch["src"].size(0)
        self._log_training_loss(loss, B)
        self._log_throughput(batch["src"].ne(self.pad_id).sum(), batch["src"].numel(), B)
        return loss

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        if not self._repeated_share():
            self._step("val", batch)

    def test_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        if not self._repeated_share():
            self._step("test", batch)

    def _log_epoch(self, stage: str) -> dict[str, float]:
        names = ("acc", "f1") if stage == "train" else ("loss", "acc", "f1")  # train/loss is per step
        return self._log_epoch_metrics(stage, names, prog_bar=("acc",))

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")

    def on_validation_epoch_end(self) -> None:
        self._log_best(self._log_epoch("val")["acc"])

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")
