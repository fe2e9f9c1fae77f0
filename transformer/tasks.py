"""LightningModules: translation (label-smoothed CE, perplexity, decoded sacreBLEU), classification, and
masked-LM pretraining of a classifier's encoder on unlabelled text.

The tasks build their model from plain data (`TransformerConfig` fields) and keep only plain data in
their hyperparameters, so checkpoints load with `torch.load(weights_only=True)`. Optimizer and
scheduler arrive as factories (Hydra partials): `optimizer(model)`, `scheduler(optimizer)`.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from transformer.config import TransformerConfig
from transformer.decoding import beam_search, check_decoding, greedy_search
from transformer.evaluation import corpus_scores
from transformer.losses import TokenLoss, label_smoothed_cross_entropy, symmetric_kl
from transformer.model import Seq2SeqTransformer, TransformerClassifier, TransformerMaskedLM
from transformer.restore import load_pretrained_encoder

log = logging.getLogger(__name__)

__all__ = ["ClassificationTask", "MaskedLMTask", "TranslationTask"]

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]

_COMPILE_PREFIX = "_orig_mod."
DEFAULT_DECODING = {"beam_size": 1, "length_penalty": 0.6, "max_len_a": 1.2, "max_len_b": 10.0}


def _plain(value: Any) -> Any:
    """Mappings / sequences (e.g. OmegaConf containers) as dicts / lists, so checkpoints hold plain data."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def _decoding_settings(name: str, defaults: Mapping[str, Any], given: Mapping[str, Any] | None) -> dict:
    settings = {**defaults, **_plain(given or {})}
    unknown = sorted(set(settings) - set(DEFAULT_DECODING))
    if unknown:
        raise ValueError(f"unknown {name} option(s) {unknown}; expected some of {sorted(DEFAULT_DECODING)}")
    check_decoding(settings, prefix=f"{name}.")
    return settings


class _Throughput:
    """Tokens per second between consecutive training steps (data loading + forward + backward + update)."""

    def __init__(self) -> None:
        self._last_time: float | None = None
        self._last_tokens = 0

    def step(self, n_tokens: int) -> float | None:
        now = time.perf_counter()
        rate = None
        if self._last_time is not None and now > self._last_time:
            rate = self._last_tokens / (now - self._last_time)
        self._last_time, self._last_tokens = now, n_tokens
        return rate

    def reset(self) -> None:  # the gap across validation or epoch ends is not training time
        self._last_time = None


class _TokenMeans(nn.Module):
    """Token-weighted means over an epoch (synced across processes by torchmetrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.loss, self.nll, self.acc = MeanMetric(), MeanMetric(), MeanMetric()

    def update(self, out: TokenLoss) -> None:
        weight = out.n_tokens.float()
        self.loss.update(out.loss.detach(), weight)
        self.nll.update(out.nll.detach(), weight)
        self.acc.update(out.n_correct.float() / out.n_tokens.clamp(min=1), weight)

    def compute_and_reset(self) -> dict[str, Tensor]:
        nll = self.nll.compute()
        values = {"loss": self.loss.compute(), "nll": nll, "ppl": nll.exp(), "token_acc": self.acc.compute()}
        for metric in (self.loss, self.nll, self.acc):
            metric.reset()
        return values


class _TaskBase(L.LightningModule):
    """What the tasks share: optimizer/scheduler wiring, optional compile, self-sufficient checkpoints,
    epoch metrics and the best value of the selection metric (`val/<name>_best`, kept in checkpoints)."""

    model: nn.Module
    best_metric: tuple[str, Literal["max", "min"]]  # the validation metric tracked as val/<name>_best

    def __init__(
        self,
        optimizer: OptimizerFactory | None,
        scheduler: SchedulerFactory | None,
        run_config: Mapping[str, Any] | None,
    ) -> None:
        super().__init__()
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        # the resolved Hydra config of the run, stored in every checkpoint (not a hyperparameter)
        self.run_config = _plain(run_config) if run_config is not None else None
        self.throughput = _Throughput()
        self.best = self._worst()

    def _worst(self) -> float:
        """Where the best value starts: below (max) or above (min) anything a validation can give."""
        return -math.inf if self.best_metric[1] == "max" else math.inf

    def _log_best(self, value: float) -> None:
        """After a real (not sanity-check) validation: fold `value` into the best so far and log it."""
        if self.trainer.sanity_checking:
            return
        name, mode = self.best_metric
        self.best = max(self.best, value) if mode == "max" else min(self.best, value)
        self.log(f"val/{name}_best", self.best, sync_dist=True)

    def _log_epoch_metrics(
        self, stage: str, names: Sequence[str], prog_bar: Sequence[str]
    ) -> dict[str, float]:
        """Compute, reset and log `self.metrics[f"{stage}_{name}"]` as `{stage}/{name}` for each name."""
        values = {}
        for name in names:
            metric = self.metrics[f"{stage}_{name}"]
            values[name] = float(metric.compute())  # synced across processes
            metric.reset()
            self.log(f"{stage}/{name}", values[name], prog_bar=name in prog_bar, sync_dist=True)
        return values

    def on_fit_start(self) -> None:
        """Fresh metric states for training. A `trainer.validate` or `trainer.test` before `fit` resets them
        under inference mode, which makes them inference tensors; fit's validation (under no_grad) could
        not update those in place."""
        for module in self.modules():
            if isinstance(module, Metric):
                module.reset()

    def configure_model(self) -> None:
        """`torch.compile` in place (`nn.Module.compile`): state_dict keys keep their names."""
        if self.hparams.get("compile") and not getattr(self, "_compiled", False):
            self.model.compile()
            self._compiled = True

    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            raise ValueError(f"{type(self).__name__} has no optimizer: pass `optimizer` (model.optimizer)")
        optimizer = self.optimizer_factory(self.model, **self._optimizer_overrides())
        if self.scheduler_factory is None:
            return optimizer
        kwargs = {}
        keywords = getattr(self.scheduler_factory, "keywords", {})
        if "total_steps" in inspect.signature(self.scheduler_factory).parameters and (
            keywords.get("total_steps") is None
        ):
            total = int(self.trainer.estimated_stepping_batches)
            warmup = keywords.get("warmup_steps") or 0
            if total <= warmup:  # a debug run (fast_dev_run, limit_train_batches) shorter than warmup
                log.warning("%d optimizer steps < warmup_steps=%d: the schedule is cut short", total, warmup)
                total = warmup + 1
            kwargs["total_steps"] = total
        scheduler = self.scheduler_factory(optimizer, **kwargs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _optimizer_overrides(self) -> dict[str, Any]:
        """A fused AdamW would unscale fp16 gradients inside its step, after clipping, so Lightning's
        mixed-precision plugin refuses to clip a fused optimizer's gradients under 16-mixed *and* bf16-mixed
        (`trainer=gpu`). With clipping on, `fused=None` (auto) becomes the foreach kernel."""
        trainer = self.trainer
        if not isinstance(trainer.precision_plugin, MixedPrecision) or not trainer.gradient_clip_val:
            return {}
        if "fused" not in inspect.signature(self.optimizer_factory).parameters:
            return {}
        if getattr(self.optimizer_factory, "keywords", {}).get("fused"):
            raise ValueError(
                f"model.optimizer.fused=true cannot clip gradients under trainer.precision="
                f"{trainer.precision} (Lightning refuses a step that unscales them itself): set "
                "model.optimizer.fused=null or trainer.gradient_clip_val=null"
            )
        return {"fused": False}

    def on_train_epoch_start(self) -> None:
        self.throughput.reset()

    def on_validation_start(self) -> None:
        self.throughput.reset()

    def _log_throughput(self, n_real: int, n_total: int, batch_size: int) -> None:
        rate = self.throughput.step(n_real)
        self.log("train/pad_ratio", 1.0 - n_real / max(n_total, 1), batch_size=batch_size)
        if rate is not None:  # per process; non-pad tokens
            self.log("train/tokens_per_s", rate, prog_bar=True, batch_size=batch_size)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        for key in [k for k in state if _COMPILE_PREFIX in k]:  # a model compiled from the outside
            state[key.replace(_COMPILE_PREFIX, "")] = state.pop(key)
        if self.run_config is not None:
            checkpoint["config"] = self.run_config
        for logger in self.loggers:  # so that `ckpt_path=` resumes the same wandb run
            if type(logger).__name__ == "WandbLogger":
                checkpoint["wandb_run_id"] = str(logger.version)
        checkpoint[f"{self.best_metric[0]}_best"] = self.best

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.best = checkpoint.get(f"{self.best_metric[0]}_best", self._worst())


class TranslationTask(_TaskBase):
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
        config = _plain(config)
        decoding = _decoding_settings("decoding", DEFAULT_DECODING, decoding)
        test_decoding = _decoding_settings("test_decoding", decoding, test_decoding)  # defaults: decoding
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
        self.val_means, self.test_means = _TokenMeans(), _TokenMeans()
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

    @torch.no_grad()
    def translate(self, src: Tensor, decoding: Mapping[str, Any] | None = None) -> Tensor:
        """src (B, S) -> best hypotheses (B, L) token ids after BOS (default settings: `decoding`)."""
        d = {**self.hparams.decoding, **(decoding or {})}
        lengths = {"max_len_a": d["max_len_a"], "max_len_b": d["max_len_b"]}
        if d["beam_size"] == 1:
            return greedy_search(self.model, src, **lengths)
        tokens, _ = beam_search(
            self.model, src, beam_size=d["beam_size"], length_penalty=d["length_penalty"], **lengths
        )
        return tokens[:, 0]  # (B, L)

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

    def _log_means(self, stage: str, means: _TokenMeans) -> None:
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


class ClassificationTask(_TaskBase):
    """Sentence classification with an encoder-only Transformer: cross entropy, accuracy, macro-F1."""

    best_metric = ("acc", "max")

    def __init__(
        self,
        config: Mapping[str, Any],
        num_classes: int,
        pooling: Literal["cls", "mean", "max"] = "cls",
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        label_smoothing: float = 0.0,
        token_dropout: float = 0.0,
        rdrop: float = 0.0,
        adversarial: float = 0.0,
        init_from: str | None = None,
        compile: bool = False,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler, run_config)
        config = _plain(config)
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
        model; the head keeps its initialization. `tokenizers` (the datamodule's `state_dict()` entry)
        must be the ones it was pretrained with. `train.py` calls this before a fresh fit, not on resume.
        Returns the number of tensors copied (0 without `init_from`)."""
        if not self.hparams.init_from:
            return 0
        loaded = load_pretrained_encoder(self.model, self.hparams.init_from, tokenizers)
        log.info("Initialized %d encoder tensors from %s", loaded, self.hparams.init_from)
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
        self.log("train/loss", loss, prog_bar=True, batch_size=B)
        self._log_throughput(int(batch["src"].ne(self.pad_id).sum()), batch["src"].numel(), B)
        return loss

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        self._step("val", batch)

    def test_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
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


class MaskedLMTask(_TaskBase):
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
        compile: bool = False,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler, run_config)
        config = _plain(config)
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
        self.log("train/loss", loss, prog_bar=True, batch_size=B)
        self.log("train/acc", acc, batch_size=B)
        self._log_throughput(int(batch["src"].ne(self.pad_id).sum()), batch["src"].numel(), B)
        return loss

    def _eval_step(self, stage: str, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        generator = torch.Generator(device=batch["src"].device).manual_seed(batch_idx)
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
