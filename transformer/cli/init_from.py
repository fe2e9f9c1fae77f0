"""`model.init_from` of a translation run, before the data is read: the run takes the checkpoint's model
config and tokenizer(s), in the checkpoint's languages; what contradicts them is refused with one line
naming the key. (A classification run's `init_from`, a masked-LM encoder, is checked when it is loaded.)"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from transformer.checkpoint import CheckpointError, load_checkpoint
from transformer.cli.errors import ConfigError
from transformer.evaluation.restore import DATAMODULES, task_of

log = logging.getLogger("train")

# model.config keys a fine-tuning run sets itself: how it trains, not what the weights are
RUN_KEYS = ("dropout", "attention_dropout", "embedding_init")


def explicit_keys(overrides: Iterable[str]) -> set[str]:
    """The keys of command-line overrides (`a.b=1`, `+a.b=1`, `~a.b`) as `a.b`."""
    return {item.split("=", 1)[0].lstrip("+~") for item in overrides}


def _is_translation(cfg: DictConfig) -> bool:
    return str(cfg.model.get("_target_", "")).rsplit(".", 1)[-1] == "TranslationTask"


def take_init_from(
    cfg: DictConfig, resumed: Mapping[str, Any] | None, explicit: Iterable[str]
) -> dict[str, str] | None:
    """For a translation run with `model.init_from`: set `cfg.model.config` to the checkpoint's (resuming:
    to the resumed run's, which took it at its start; `init_from` is not read again). A `model.config`
    key given on the command line (`explicit`) that contradicts it, or `data.src_lang` / `data.tgt_lang`
    other than the checkpoint's, is a ConfigError. Returns the checkpoint's tokenizer(s) for the datamodule
    (None when resuming: the resumed checkpoint's are loaded with its datamodule state)."""
    path = cfg.model.get("init_from")
    if not path or not _is_translation(cfg):
        return None
    if resumed is not None:
        source, checkpoint = f"ckpt_path={cfg.ckpt_path}", resumed
    else:
        source = f"model.init_from={path}"
        try:
            checkpoint = load_checkpoint(path)
        except CheckpointError as err:
            raise ConfigError(f"model.init_from: {err}") from None
        _check_task(checkpoint, path)
        _check_languages(cfg, checkpoint, path)
    saved = dict(checkpoint["hyper_parameters"]["config"])
    _take_config(cfg, saved, source, set(explicit))
    max_len = cfg.data.get("max_len")
    if isinstance(max_len, int) and isinstance(saved.get("max_len"), int) and max_len > saved["max_len"]:
        raise ConfigError(
            f"data.max_len ({max_len}) exceeds the max_len of {source} ({saved['max_len']}): the model "
            "would get sequences longer than its positions"
        )
    if resumed is not None:
        return None
    tokenizers = (checkpoint.get(DATAMODULES["translation"]) or {}).get("tokenizers")
    if not tokenizers:
        raise ConfigError(f"model.init_from={path} carries no tokenizer: its token ids cannot be read")
    return dict(tokenizers)


def _check_task(checkpoint: Mapping[str, Any], path: str) -> None:
    hparams = checkpoint.get("hyper_parameters")
    if isinstance(hparams, Mapping) and "mask_prob" in hparams:
        raise ConfigError(
            f"model.init_from={path} is a masked-LM pretraining checkpoint: it starts a classifier "
            "(experiment=sst2), not a translation model"
        )
    try:
        kind = task_of(checkpoint, path)
    except CheckpointError as err:
        raise ConfigError(f"model.init_from: {err}") from None
    if kind != "translation":
        raise ConfigError(
            f"model.init_from={path} is a {kind} checkpoint: a translation run starts from a translation "
            "checkpoint (trained here, or imported with aiayn-import)"
        )


def _check_languages(cfg: DictConfig, checkpoint: Mapping[str, Any], path: str) -> None:
    saved = (checkpoint.get("config") or {}).get("data") or {}
    for key in ("src_lang", "tgt_lang"):
        theirs, ours = saved.get(key), cfg.data.get(key)
        if theirs is not None and ours is not None and theirs != ours:
            raise ConfigError(
                f"data.{key}={ours} but model.init_from={path} translates {saved.get('src_lang')} -> "
                f"{saved.get('tgt_lang')}: fine-tune it on data in its languages"
            )


def _take_config(cfg: DictConfig, saved: dict[str, Any], source: str, explicit: set[str]) -> None:
    ours = OmegaConf.to_container(cfg.model.get("config") or {}, resolve=True)
    assert isinstance(ours, dict)
    for key, value in ours.items():
        if key in RUN_KEYS or f"model.config.{key}" not in explicit:
            continue
        if key not in saved or saved[key] != value:
            raise ConfigError(
                f"model.config.{key}={value!r} contradicts {source} ({saved.get(key)!r}): a fine-tuning run "
                f"takes the checkpoint's model config; leave model.config.{key} unset"
            )
    replaced = sorted(k for k in saved if k not in RUN_KEYS and k in ours and ours[k] != saved[k])
    if replaced:
        log.info("model.config from %s: %s", source, ", ".join(f"{k}={saved[k]!r}" for k in replaced))
    with open_dict(cfg):
        cfg.model.config = {**saved, **{k: ours[k] for k in RUN_KEYS if k in ours}}
