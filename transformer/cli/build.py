"""Components from the config: `hydra.utils.instantiate` with the argument types checked against each
`_target_`'s signature first, and every failure as one line naming the config key."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig, OmegaConf, open_dict

from transformer.checkpoint import CheckpointError
from transformer.cli.arguments import ArgumentError, check_arguments
from transformer.cli.checks import check_checkpoint_fits
from transformer.cli.errors import ConfigError
from transformer.cli.process import set_matmul_precision
from transformer.lora import FinetuneSettings

log = logging.getLogger("train")


def instantiate(node: DictConfig, key: str, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate` with plain containers, turning failures into one line naming `key`."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(f"`{key}` needs a `_target_` (the class to build), got {node!r}")
    _check_types(OmegaConf.to_container(node, resolve=True), key)
    try:
        return hydra.utils.instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:
        cause = err.__cause__ or err
        message = naming_key(str(cause), key, node)
        raise ConfigError(
            f"cannot build `{key}` ({node._target_}): {type(cause).__name__}: {message}"
        ) from err


def _check_types(value: Any, key: str) -> None:
    """Every `_target_` in the tree gets values of the types its signature declares."""
    if isinstance(value, Mapping):
        if isinstance(value.get("_target_"), str):
            try:
                target = hydra.utils.get_object(value["_target_"])
            except Exception:  # not importable: instantiating it reports that
                target = None
            if target is not None:
                if value.get("_partial_"):  # null arguments of a partial: the caller may fill them in
                    value = {name: item for name, item in value.items() if item is not None}
                try:
                    check_arguments(target, value, key)
                except ArgumentError as err:
                    raise ConfigError(str(err)) from err
        for name, item in value.items():
            _check_types(item, f"{key}.{name}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_types(item, f"{key}[{index}]")


def instantiate_group(node: DictConfig | None, key: str) -> list[Any]:
    """Callbacks / loggers: a mapping of name -> config with `_target_`; null entries are switched off."""
    if not node:
        return []
    if not isinstance(node, DictConfig):
        raise ConfigError(f"`{key}` must be a mapping of name -> config, got {node!r}")
    built = []
    for name, conf in node.items():
        if conf is None:
            continue
        if isinstance(conf, DictConfig) and "_target_" not in conf:
            # e.g. `callbacks=none` with an experiment that still sets `callbacks.early_stopping.patience`
            log.warning("%s.%s has no _target_ (only %s): skipped", key, name, OmegaConf.to_container(conf))
            continue
        built.append(instantiate(conf, f"{key}.{name}"))
    return built


def naming_key(message: str, key: str, node: Mapping[str, Any]) -> str:
    """ "vocab_size must ..." from the component built from `node` as "`data.vocab_size` must ..."."""
    first, _, rest = message.partition(" ")
    return f"`{key}.{first}` {rest}" if rest and first.split(".", 1)[0] in node else message


def fill_from_data(cfg: DictConfig, datamodule: Any) -> None:
    """Write the tokenizer's vocabulary sizes and special ids (and the classes) into `cfg.model`."""
    fields = {"pad_id": datamodule.pad_id, "bos_id": datamodule.bos_id, "eos_id": datamodule.eos_id}
    extra = {}
    if hasattr(datamodule, "tgt_vocab_size"):
        fields.update(src_vocab_size=datamodule.src_vocab_size, tgt_vocab_size=datamodule.tgt_vocab_size)
    else:
        fields.update(src_vocab_size=datamodule.vocab_size, tgt_vocab_size=datamodule.vocab_size)
        if _accepts(cfg.model.get("_target_"), "num_classes"):  # not masked-LM pretraining
            extra["num_classes"] = datamodule.num_classes
    with open_dict(cfg):
        for name, value in fields.items():
            current = cfg.model.config.get(name)
            if current is not None and current != value:
                raise ConfigError(
                    f"model.config.{name}={current} disagrees with the data ({value}); leave it unset"
                )
            cfg.model.config[name] = value
        for name, value in extra.items():
            cfg.model[name] = value


def _accepts(target: Any, name: str) -> bool:
    """Whether the class or function `target` (a `_target_` string) takes a `name` argument; True when it
    cannot be imported, so that instantiating it reports the problem."""
    try:
        return name in inspect.signature(hydra.utils.get_object(str(target))).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        return True


def check_optimizer(task: Any) -> None:
    """Build the optimizer once now: a bad `model.optimizer` value fails before anything is written."""
    factory = getattr(task, "optimizer_factory", None)
    if factory is None:
        return
    try:
        optimizer = factory(task.model)
    except (TypeError, ValueError) as err:
        message = naming_key(str(err), "model.optimizer", getattr(factory, "keywords", {}))
        raise ConfigError(f"cannot build `model.optimizer`: {type(err).__name__}: {message}") from err
    scheduler = getattr(task, "scheduler_factory", None)
    if scheduler is None:
        return
    keywords = getattr(scheduler, "keywords", {})
    kwargs = {}
    if "total_steps" in inspect.signature(scheduler).parameters and keywords.get("total_steps") is None:
        kwargs["total_steps"] = (keywords.get("warmup_steps") or 0) + 1  # the task fills in the real one
    try:
        scheduler(optimizer, **kwargs)
    except (TypeError, ValueError) as err:
        message = naming_key(str(err), "model.scheduler", keywords)
        raise ConfigError(f"cannot build `model.scheduler`: {type(err).__name__}: {message}") from err


def load_init_from(task: Any, datamodule: Any) -> None:
    """`model.init_from`: the pretrained encoder, checked (task, tokenizer, shapes) before anything is
    written."""
    try:
        task.load_init_from(datamodule.state_dict().get("tokenizers"))
    except CheckpointError as err:
        raise ConfigError(str(err)) from err


def finetune_argument(cfg: DictConfig) -> dict[str, Any]:
    """`finetune` (freeze, LoRA) for a task that takes it; refused for one that does not (masked-LM
    pretraining) unless it leaves everything as it is."""
    node = cfg.get("finetune")
    if node is None:
        return {}
    values = OmegaConf.to_container(node, resolve=True)
    lora = (values.get("lora") or {}) if isinstance(values, dict) else {}
    if _composed_option("finetune") == "lora" and isinstance(lora, dict) and not lora.get("rank"):
        raise ConfigError(
            f"finetune=lora with finetune.lora.rank={lora.get('rank')}: rank 0 means no adapters, so every "
            "weight would train; give a rank >= 1 (finetune=lora's own is 8), or leave out finetune=lora"
        )
    if _accepts(cfg.model.get("_target_"), "finetune"):
        return {"finetune": values}  # the task reads it (`FinetuneSettings`), refusing a bad value by its key
    if isinstance(values, dict) and _changes_nothing(values):
        return {}
    raise ConfigError(
        f"finetune.* needs a translation or classification model; {cfg.model._target_} takes none"
    )


def _changes_nothing(values: dict[str, Any]) -> bool:
    """Whether the `finetune` values leave every weight as it is (one that `FinetuneSettings` refuses
    does not)."""
    try:
        return not FinetuneSettings.from_values(values).active
    except ValueError:
        return False


def _composed_option(group: str) -> str | None:
    """The option of config group `group` that Hydra composed this run with (None outside a Hydra run)."""
    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get(group)


def check_same_finetune(cfg: DictConfig, checkpoint: Mapping[str, Any], finetune: Any) -> None:
    """A resumed run keeps its `finetune` settings: its checkpoint holds the weights in their layout (LoRA
    adapters) and the optimizer state of the parameters they left trainable."""
    saved = (checkpoint.get("hyper_parameters") or {}).get("finetune")
    if saved is not None and finetune is not None and saved != finetune:
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path} was trained with finetune={saved}; this run sets finetune={finetune} "
            "(resume with the same finetune settings)"
        )


def with_wandb_id(cfg: DictConfig, checkpoint: Mapping[str, Any] | None) -> DictConfig | None:
    """Resuming from a checkpoint continues its wandb run unless `logger.wandb.id` is set."""
    loggers = cfg.get("logger")
    run_id = checkpoint.get("wandb_run_id") if checkpoint else None
    if loggers and run_id and loggers.get("wandb") and loggers.wandb.get("id") is None:
        with open_dict(loggers):
            loggers.wandb.id = run_id
        log.info("Resuming wandb run %s", run_id)
    return loggers


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The run's config as plain data, every interpolation resolved (Hydra's own node left out)."""
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


def build_task(cfg: DictConfig, datamodule: Any, checkpoint: Mapping[str, Any] | None) -> Any:
    """The task (LightningModule) of `cfg.model`, its vocabulary filled in from the data, checked against
    the checkpoint it resumes from; its optimizer and schedule built once to check their values; the
    pretrained encoder of `model.init_from` loaded on a fresh start."""
    fill_from_data(cfg, datamodule)
    finetune = finetune_argument(cfg)
    if checkpoint is not None:
        check_checkpoint_fits(cfg, checkpoint)
        check_same_finetune(cfg, checkpoint, finetune.get("finetune"))
    task = instantiate(cfg.model, "model", **finetune)
    check_optimizer(task)
    if checkpoint is None and hasattr(task, "load_init_from"):
        load_init_from(task, datamodule)
    task.run_config = resolved_config(cfg)  # stored in every checkpoint
    return task


def build_trainer(cfg: DictConfig, checkpoint: Mapping[str, Any] | None) -> L.Trainer:
    """The Trainer of `cfg.trainer` with the configured callbacks and loggers (a resumed run continues
    its wandb run)."""
    callbacks = instantiate_group(cfg.get("callbacks"), "callbacks")
    loggers = instantiate_group(with_wandb_id(cfg, checkpoint), "logger")
    if not loggers:  # Lightning refuses a learning-rate monitor with nothing to log to
        callbacks = [c for c in callbacks if type(c).__name__ != "LearningRateMonitor"]
    if cfg.trainer.get("enable_progress_bar") is False:  # and a progress bar with the bar switched off
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    trainer: L.Trainer = instantiate(cfg.trainer, "trainer", callbacks=callbacks, logger=loggers or False)
    set_matmul_precision(cfg, trainer)
    return trainer
