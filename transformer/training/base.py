"""What the tasks share: the LightningModule base (optimizer and scheduler wiring, optional compile,
self-sufficient checkpoints, the best value of the selection metric) and its small helpers."""

from __future__ import annotations

import inspect
import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric

from transformer.checkpoint import strip_compile_prefix
from transformer.evaluation.restore import STARTED_FROM_KEY, started_from, with_stable_keys
from transformer.lora import FinetuneSettings
from transformer.losses import TokenLoss
from transformer.norm import residual_in_autocast_dtype
from transformer.stacks import checkpoint_layers, compile_layers
from transformer.training.compiling import CompiledStep
from transformer.training.finetune import apply_finetune
from transformer.training.lightning_private import should_update_logs
from transformer.training.schedules import warmup_of
from transformer.training.validation_schedule import max_steps_before_validation

# ModelCheckpoint's warning when it saves without the monitored metric (Lightning 2.x wording)
_NO_MONITORED_KEY = r"`ModelCheckpoint\(monitor=.*\)` could not find the monitored key"
log = logging.getLogger(__name__)

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]


def plain(value: Any) -> Any:
    """Mappings / sequences (e.g. OmegaConf containers) as dicts / lists, so checkpoints hold plain data."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(v) for v in value]
    return value


class Throughput:
    """Tokens per second between consecutive training steps (data loading + forward + backward + update).

    Token counts stay on the device: the rate is a device tensor (the previous step's count over the
    host-timed gap), which the logger reads back only when it writes (`log_every_n_steps`)."""

    def __init__(self) -> None:
        self._last_time: float | None = None
        self._last_tokens: Tensor | None = None

    def step(self, n_tokens: Tensor) -> Tensor | None:
        now = time.perf_counter()
        rate = None
        if self._last_time is not None and self._last_tokens is not None and now > self._last_time:
            rate = self._last_tokens / (now - self._last_time)
        self._last_time, self._last_tokens = now, n_tokens
        return rate

    def reset(self) -> None:  # the gap across validation or epoch ends is not training time
        self._last_time = None


class ProgressValues:
    """Values for the progress bar, each device tensor read back once (when the bar next asks), not
    after every batch."""

    def __init__(self) -> None:
        self._pending: dict[str, Tensor] = {}
        self._values: dict[str, float] = {}

    def set(self, name: str, value: Tensor) -> None:
        self._pending[name] = value.detach()

    def read(self) -> dict[str, float]:
        if self._pending:
            names = list(self._pending)
            values = torch.stack([self._pending[n].float().to(self._pending[names[0]].device) for n in names])
            self._values.update(zip(names, values.tolist()))  # one read for all of them
            self._pending.clear()
        return dict(self._values)


class TokenMeans(nn.Module):
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


class TaskBase(L.LightningModule):
    """What the tasks share: optimizer/scheduler wiring, optional compile, self-sufficient checkpoints,
    epoch metrics and the best value of the selection metric (`val/<name>_best`, kept in checkpoints)."""

    model: nn.Module
    best_metric: tuple[str, Literal["max", "min"]]  # the validation metric tracked as val/<name>_best
    _compiled_step: CompiledStep | None = None  # a task's compiled training step (`_compile`)
    compile_backend = "inductor"  # torch.compile's backend for `model.compile` (tests use "eager")
    compile_fullgraph = False  # True: a graph break is an error (the tests' setting)
    finetune_settings = FinetuneSettings()  # `finetune` (set by the tasks that take it)
    trainable_modules: tuple[str, ...] = ()  # new modules that LoRA leaves trainable (a classifier's head)
    _finetuned = False
    # `model.init_from` and what it was imported from (`init_origin`), saved in every checkpoint
    started_from: dict[str, Any] | None = None

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
        self.run_config = plain(run_config) if run_config is not None else None
        self.throughput = Throughput()
        self.progress_values = ProgressValues()
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

    def _repeated_share(self) -> bool:
        """Whether this process's evaluation batches repeat another process's (a split with fewer batches
        than processes: `TokenBudgetBatchSampler.repeats_another_rank`): they run so that the process
        joins the epoch's collectives, but their metrics would count twice in the synced values."""
        loaders = self.trainer.test_dataloaders if self.trainer.testing else self.trainer.val_dataloaders
        return bool(getattr(getattr(loaders, "batch_sampler", None), "repeats_another_rank", False))

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

    def _take_finetune(self, finetune: Mapping[str, Any] | None) -> None:
        """`finetune` (freeze, LoRA) checked against the built model; applied by `configure_model`."""
        self.finetune_settings = FinetuneSettings.from_values(plain(finetune))
        self.finetune_settings.check_fits(self.model)

    def apply_finetune(self) -> None:
        """Freeze and add the LoRA adapters, once: after `model.init_from` was loaded (train.py loads it
        before fitting) and before a resumed checkpoint, saved in that layout, is restored."""
        if self._finetuned or not self.finetune_settings.active:
            return
        if not self.hparams.get("init_from"):
            log.warning("finetune.* without model.init_from: the frozen weights are the random initial ones")
        message = apply_finetune(self.model, self.finetune_settings, self.trainable_modules)
        self._finetuned = True
        log.info("%s", message)

    def configure_model(self) -> None:
        """Fine-tuning's freezing and LoRA adapters (`apply_finetune`), activation checkpointing
        (`model.activation_checkpointing`: each encoder / decoder layer recomputed in the backward pass),
        the residual stream in the autocast dtype (`model.low_precision_residual`, `transformer.norm`),
        then `torch.compile` (`_compile`)."""
        self.apply_finetune()
        if self.hparams.get("activation_checkpointing") and not checkpoint_layers(self.model):
            raise ValueError(
                "model.activation_checkpointing=true, but the model has no encoder or decoder layer to "
                "recompute"
            )
        low_precision = self.hparams.get("low_precision_residual", "auto")
        if not (isinstance(low_precision, bool) or low_precision == "auto"):
            raise ValueError(
                f"model.low_precision_residual must be true, false or auto, got {low_precision!r}"
            )
        if low_precision == "auto":  # on where a GPU A/B measured it (docs/gpu.md), off on the CPU
            trainer = getattr(self, "_trainer", None)
            device = trainer.strategy.root_device if trainer is not None else self.device
            low_precision = device.type == "cuda"
        residual_in_autocast_dtype(self.model, low_precision)
        if self.hparams.get("compile") and not getattr(self, "_compiled", False):
            self._compile()
            self._compiled = True

    def _compile(self) -> None:
        """`model.compile=true`: the model's forward through `torch.compile`, in place (`nn.Module.compile`:
        state_dict keys keep their names); `model.compile=layers`: its encoder / decoder layers in training
        (`compile_layers`). A task may compile its training step instead."""
        if self.hparams.get("compile") == "layers":
            compile_layers(self.model, self.compile_backend, self.compile_fullgraph)
        else:
            self.model.compile(backend=self.compile_backend, fullgraph=self.compile_fullgraph)

    def configure_optimizers(self) -> Any:
        if self.optimizer_factory is None:
            raise ValueError(f"{type(self).__name__} has no optimizer: pass `optimizer` (model.optimizer)")
        optimizer = self.optimizer_factory(self.model, **self._optimizer_overrides())
        if self.scheduler_factory is None:
            return optimizer
        kwargs = {}
        keywords = getattr(self.scheduler_factory, "keywords", {})
        parameters = inspect.signature(self.scheduler_factory).parameters
        warmup = keywords.get("warmup_steps", getattr(parameters.get("warmup_steps"), "default", None))
        if "total_steps" in parameters or isinstance(warmup, int):
            total = int(self.trainer.estimated_stepping_batches)
            if warmup is None and keywords.get("warmup_ratio"):
                warmup = warmup_of(total, None, keywords["warmup_ratio"])
            if isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= total:
                # every schedule: a fine-tuning run (a few hundred steps) under a from-scratch warmup
                # (model.scheduler.warmup_steps 800 or 4000) never reaches its learning rate
                log.warning(
                    "model.scheduler.warmup_steps=%d is not shorter than the run (%d optimizer steps): the "
                    "learning rate never reaches its peak; lower the warmup (a fine-tuning preset: "
                    "experiment=finetune_opus_mt or finetune_bert_sst2)",
                    warmup,
                    total,
                )
            if "total_steps" in parameters and keywords.get("total_steps") is None:
                kwargs["total_steps"] = max(total, (warmup if isinstance(warmup, int) else 0) + 1)
        scheduler = self.scheduler_factory(optimizer, **kwargs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _optimizer_overrides(self) -> dict[str, Any]:
        """Under 16-mixed with clipping on, `fused=None` (auto) becomes the foreach kernel: a fused AdamW
        unscales the GradScaler's gradients inside its step, after clipping would have cut them at the
        wrong size, so Lightning refuses to clip its gradients. bf16-mixed (`trainer=gpu`) has no loss
        scale and keeps the fused kernel (`configure_gradient_clipping`)."""
        trainer = self.trainer
        if getattr(trainer.precision_plugin, "scaler", None) is None or not trainer.gradient_clip_val:
            return {}
        if "fused" not in inspect.signature(self.optimizer_factory).parameters:
            return {}
        if getattr(self.optimizer_factory, "keywords", {}).get("fused"):
            raise ValueError(
                f"model.optimizer.fused=true cannot clip gradients under trainer.precision="
                f"{trainer.precision} (its loss scale must be taken off before clipping, and a fused "
                "optimizer takes it off inside its step): set model.optimizer.fused=null or "
                "trainer.gradient_clip_val=null"
            )
        return {"fused": False}

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip as under 32-true when no GradScaler scales the loss (bf16-mixed): the gradients already have
        their true size, and the fused kernel's own unscaling has nothing to undo. Lightning's
        mixed-precision plugin refuses to clip for any optimizer that unscales itself (an fp16 rule), which
        would cost the fused AdamW and, with it, the guard's device-side skip. The clip
        (Lightning's `clip_grad_norm_` call: foreach, no `error_if_nonfinite`) scales on the device and
        reads nothing back, the same clip as under 32-true."""
        plugin = self.trainer.precision_plugin
        if not isinstance(plugin, MixedPrecision) or plugin.scaler is not None:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        if gradient_clip_val:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)  # not the fp16 refusal

    def on_train_start(self) -> None:
        message = max_steps_before_validation(self.trainer)
        if message is not None and self.trainer.is_global_zero:
            log.warning("%s", message)
        if message is not None or self.trainer.limit_val_batches == 0:
            # the run validates nothing before it ends (said above, or asked for with limit_val_batches=0):
            # ModelCheckpoint then warns at each save that it "could not find the monitored key", which
            # says the same thing again as Lightning's hint to log the metric; kept out until fit ends
            warnings.filterwarnings("ignore", message=_NO_MONITORED_KEY)
            self._quiet_filter = warnings.filters[0]

    def on_fit_end(self) -> None:
        quiet = getattr(self, "_quiet_filter", None)
        if quiet is not None and quiet in warnings.filters:
            warnings.filters.remove(quiet)
            # what warnings.filterwarnings calls after a change, so that no module's registry keeps the
            # "ignore" it cached (3.11-3.12: _filters_mutated; 3.13: _filters_mutated_lock_held)
            mutated = getattr(warnings, "_filters_mutated", None) or getattr(
                warnings, "_filters_mutated_lock_held", None
            )
            if mutated is not None:
                mutated()
        self._quiet_filter = None

    def on_train_epoch_start(self) -> None:
        self.throughput.reset()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._compiled_step is not None:
            self._compiled_step.finished()  # logs how long a compilation in this step took

    def on_validation_start(self) -> None:
        self.throughput.reset()

    def _log_training_loss(self, loss: Tensor, batch_size: int) -> None:
        """`train/loss` to the loggers every step, and as `loss` on the progress bar (`_on_progress_bar`)."""
        self.log("train/loss", loss, batch_size=batch_size)
        self._on_progress_bar("loss", loss, batch_size)

    def _on_progress_bar(self, name: str, value: Tensor, batch_size: int) -> None:
        """Show `value` on the progress bar as `name` (`transformer.training.callbacks.RichProgressBar`),
        refreshed when the logs are written (every `log_every_n_steps`). Not `self.log(prog_bar=True)`:
        Lightning reads those back to the host after every batch, a wait for the device each step."""
        if should_update_logs(self.trainer):
            self.progress_values.set(name, value)

    def _log_throughput(self, n_real: Tensor, n_total: int, batch_size: int) -> None:
        """`n_real` (a device scalar): the batch's non-pad tokens; `n_total`: all its positions. Nothing is
        read back here (the logger reads the values when it writes)."""
        rate = self.throughput.step(n_real.detach())
        self.log("train/pad_ratio", 1.0 - n_real.detach() / max(n_total, 1), batch_size=batch_size)
        if rate is not None:  # per process; non-pad tokens
            self.log("train/tokens_per_s", rate, batch_size=batch_size)
            self._on_progress_bar("tokens/s", rate, batch_size)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a model compiled from the outside: its parameters are saved under their own names
        checkpoint["state_dict"] = strip_compile_prefix(checkpoint["state_dict"])
        if self.run_config is not None:
            checkpoint["config"] = self.run_config
        for logger in self.loggers:  # so that `ckpt_path=` resumes the same wandb run
            if type(logger).__name__ == "WandbLogger":
                checkpoint["wandb_run_id"] = str(logger.version)
        checkpoint[f"{self.best_metric[0]}_best"] = self.best
        if self.started_from is not None:
            checkpoint[STARTED_FROM_KEY] = self.started_from
        with_stable_keys(checkpoint)  # the tokenizers (class names) where programs read them (inference)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.best = checkpoint.get(f"{self.best_metric[0]}_best", self._worst())
        self.started_from = started_from(checkpoint) or self.started_from  # a resumed fine-tuning run's
