"""Translation: label-smoothed cross entropy, perplexity and decoded sacreBLEU on validation and test."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from transformer.config import TransformerConfig
from transformer.decoding import DecodingSettings, decode
from transformer.evaluation.scoring import corpus_scores
from transformer.losses import TokenLoss, label_smoothed_cross_entropy
from transformer.model import Seq2SeqTransformer
from transformer.training.base import (
    OptimizerFactory,
    SchedulerFactory,
    TaskBase,
    TokenMeans,
    plain,
)

log = logging.getLogger(__name__)


class TranslationTask(TaskBase):
    """Sequence-to-sequence training (section 5) with validation BLEU from greedy or beam search."""

    best_metric = ("bleu", "max")

    def __init__(
        self,
        config: Mapping[str, Any],
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        label_smoothing: float = 0.1,
        decoding: Mapping[str, Any] | None = None,
        test_decoding: Mapping[str, Any] | None = None,
        val_bleu_every_n_epochs: int = 1,
        compile: bool = False,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler, run_config)
        config = plain(config)
        # plain dicts in the hyperparameters (checkpoints hold plain data); test defaults to validation's
        decoding = dict(DecodingSettings.from_values(plain(decoding), prefix="decoding."))
        test_decoding = dict(DecodingSettings.from_values(plain(test_decoding), decoding, "test_decoding."))
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
        if isinstance(val_bleu_every_n_epochs, bool) or not (
            isinstance(val_bleu_every_n_epochs, int) and val_bleu_every_n_epochs >= 1
        ):
            raise ValueError(
                f"val_bleu_every_n_epochs must be an integer >= 1, got {val_bleu_every_n_epochs!r}"
            )
        self.save_hyperparameters(logger=False, ignore=["optimizer", "scheduler", "run_config"])
        self.model = Seq2SeqTransformer(TransformerConfig.from_dict(config))
        self.pad_id = self.model.config.pad_id
        self.val_means, self.test_means = TokenMeans(), TokenMeans()
        self._hypotheses: dict[int, str] = {}  # example id -> detokenized hypothesis, this epoch

    # --- loss -------------------------------------------------------------------------------------

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V)."""
        return self.model(src, tgt_in)

    def _token_loss(self, batch: Mapping[str, Tensor]) -> TokenLoss:
        tgt_out = batch["tgt_out"]
        keep = tgt_out.ne(self.pad_id)  # (B, T)
        # only the non-pad positions: the layers, the (D x V) projection and the softmax skip the padding
        hidden = self.model(batch["src"], batch["tgt_in"], return_hidden=True, positions=keep)  # (N, D)
        logits = self.model.output_projection(hidden)  # (N, V)
        return label_smoothed_cross_entropy(
            logits, tgt_out[keep], ignore_index=self.pad_id, label_smoothing=self.hparams.label_smoothing
        )

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        out = self._token_loss(batch)
        B = batch["src"].size(0)
        self.log("train/loss", out.loss, prog_bar=True, batch_size=B)
        self.log("train/ppl", out.nll.detach().exp(), batch_size=B)
        self.log("train/token_acc", out.n_correct / out.n_tokens.clamp(min=1), batch_size=B)
        n_src = int(batch["src"].ne(self.pad_id).sum())
        self._log_throughput(n_src + int(out.n_tokens), batch["src"].numel() + batch["tgt_out"].numel(), B)
        return out.loss

    # --- validation and test: token metrics, then decoding and BLEU -------------------------------

    def _decodes_this_epoch(self) -> bool:
        if self.trainer.sanity_checking:
            return True  # one batch through the decoding path before training starts
        return (self.current_epoch + 1) % self.hparams.val_bleu_every_n_epochs == 0

    def on_validation_epoch_start(self) -> None:
        self._hypotheses = {}

    def on_test_epoch_start(self) -> None:
        self._hypotheses = {}

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        self.val_means.update(self._token_loss(batch))
        if self._decodes_this_epoch():
            self._decode(batch)

    def test_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        self.test_means.update(self._token_loss(batch))
        self._decode(batch)

    def translate(self, src: Tensor, decoding: Mapping[str, Any] | None = None) -> Tensor:
        """src (B, S) -> best hypotheses (B, L) after BOS (`decoding` over the validation settings)."""
        return decode(self.model, src, DecodingSettings.from_values(decoding, self.hparams.decoding))

    def _decode(self, batch: Mapping[str, Tensor]) -> None:
        settings = self.hparams.test_decoding if self.trainer.testing else self.hparams.decoding
        tokens = self.translate(batch["src"], settings)  # (B, L)
        texts = self._datamodule().tgt_tokenizer.decode_batch(tokens.tolist())
        self._hypotheses.update(zip(batch["id"].tolist(), texts))

    def on_validation_epoch_end(self) -> None:
        self._log_means("val", self.val_means)
        if not self._decodes_this_epoch():
            return
        scores = self._score("val")
        for name, value in scores.items():
            self.log(f"val/{name}", value, prog_bar=name == "bleu", sync_dist=True)
        self._log_best(scores["bleu"])

    def on_test_epoch_end(self) -> None:
        self._log_means("test", self.test_means)
        for name, value in self._score("test").items():
            self.log(f"test/{name}", value, sync_dist=True)

    def _log_means(self, stage: str, means: TokenMeans) -> None:
        for name, value in means.compute_and_reset().items():
            self.log(f"{stage}/{name}", value, prog_bar=name == "loss", sync_dist=True)

    def _score(self, stage: Literal["val", "test"]) -> dict[str, float]:
        """`corpus_scores` (sacreBLEU cased and lowercased, chrF, exact match) of this epoch's hypotheses,
        and `n_sentences`, how many sentences they were computed on.

        Under DDP every process decodes the whole split (the evaluation samplers are not sharded);
        the gather merges what they decoded (by example id), so all of them compute the same corpus
        scores (corpus BLEU is not a mean of per-process BLEUs).
        """
        hypotheses = self._gather(self._hypotheses)
        self._hypotheses = {}
        references = self._datamodule().references(self._split_name(stage))
        ids = sorted(hypotheses)
        scores = corpus_scores([hypotheses[i] for i in ids], [references[i] for i in ids])
        return {**scores, "n_sentences": float(len(ids))}

    def _gather(self, local: dict[int, str]) -> dict[int, str]:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return dict(local)
        parts: list[dict[int, str] | None] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, local)
        merged: dict[int, str] = {}
        for part in parts:
            merged.update(part or {})
        return merged

    def _datamodule(self) -> Any:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None:
            raise ValueError(
                "TranslationTask decodes against a datamodule's tokenizer and references: "
                "pass `datamodule=` to the Trainer's fit/validate/test"
            )
        return datamodule

    def _split_name(self, stage: str) -> str:
        """The datamodule's name of the split that `stage` scores (e.g. test -> test_2016_flickr)."""
        splits = getattr(self._datamodule(), "splits", None)
        return splits[stage] if isinstance(splits, Mapping) and stage in splits else stage
