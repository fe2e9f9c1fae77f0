"""`model.init_from`, before the data is read: a run that fine-tunes a translation checkpoint, or a
classification one (trained here, or an imported BERT), takes its model config (and pooling) and tokenizer(s),
in its languages; what contradicts them is refused with one line naming the key. (A masked-LM checkpoint
starts a classifier's encoder only: the run keeps its own config and tokenizer, checked when it is loaded.)"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from transformer.checkpoint import CheckpointError, load_checkpoint
from transformer.cli.errors import ConfigError
from transformer.evaluation.restore import DATAMODULES, LANGUAGE_LABELS_KEY, is_masked_lm, task_of

log = logging.getLogger("train")

__all__ = ["check_languages", "explicit_keys", "take_init_from"]

# model.config keys a fine-tuning run sets itself: how it trains, not what the weights are
RUN_KEYS = ("dropout", "attention_dropout", "embedding_init")


def explicit_keys(overrides: Iterable[str]) -> set[str]:
    """The keys of command-line overrides (`a.b=1`, `+a.b=1`, `~a.b`) as `a.b`."""
    return {item.split("=", 1)[0].lstrip("+~") for item in overrides}


_KINDS = {"TranslationTask": "translation", "ClassificationTask": "classification"}


def _kind(cfg: DictConfig) -> str | None:
    return _KINDS.get(str(cfg.model.get("_target_", "")).rsplit(".", 1)[-1])


def take_init_from(
    cfg: DictConfig, resumed: Mapping[str, Any] | None, explicit: Iterable[str]
) -> dict[str, Any] | None:
    """For a run with `model.init_from` of its own task: set `cfg.model.config` (and a classifier's
    `pooling`) to the checkpoint's (resuming: to the resumed run's, which took it at its start; `init_from`
    is not read again). A `model.config` key (or `model.pooling`) given on the command line (`explicit`)
    that contradicts it, or `data.src_lang` / `data.tgt_lang` other than the checkpoint's, is a
    ConfigError. Returns the datamodule state the run starts from: the checkpoint's tokenizer(s)
    (`tokenizers`) and a multilingual model's target-language labels (`language_labels`, which the run's
    sources keep: `TranslationDataModule.load_state_dict` checks the run's pairs against them); None
    when resuming (the resumed checkpoint's are loaded with its datamodule state) and for a masked-LM
    checkpoint."""
    path, kind = cfg.model.get("init_from"), _kind(cfg)
    if not path or kind is None:
        return None
    if resumed is not None:
        source, checkpoint = f"ckpt_path={cfg.ckpt_path}", resumed
    else:
        source = f"model.init_from={path}"
        try:
            checkpoint = load_checkpoint(path)
        except CheckpointError as err:
            raise ConfigError(f"model.init_from: {err}") from None
        if kind == "classification" and is_masked_lm(checkpoint.get("hyper_parameters")):
            return None  # its encoder starts the classifier: the run's own config and tokenizer
        _check_task(checkpoint, path, kind)
        _check_languages(cfg, checkpoint, path)
    hparams = checkpoint["hyper_parameters"]
    saved = dict(hparams["config"])
    _take_config(cfg, saved, source, set(explicit))
    if kind == "classification" and hparams.get("pooling") is not None:
        _take_pooling(cfg, hparams["pooling"], source, set(explicit))
    max_len = cfg.data.get("max_len")
    if isinstance(max_len, int) and isinstance(saved.get("max_len"), int) and max_len > saved["max_len"]:
        raise ConfigError(
            f"data.max_len ({max_len}) exceeds the max_len of {source} ({saved['max_len']}): the model "
            "would get sequences longer than its positions"
        )
    if resumed is not None:
        return None
    tokenizers = (checkpoint.get(DATAMODULES[kind]) or {}).get("tokenizers")
    if not tokenizers:
        raise ConfigError(f"model.init_from={path} carries no tokenizer: its token ids cannot be read")
    labels = checkpoint.get(LANGUAGE_LABELS_KEY)
    return {"tokenizers": dict(tokenizers), **({LANGUAGE_LABELS_KEY: labels} if labels else {})}


def _check_task(checkpoint: Mapping[str, Any], path: str, kind: str) -> None:
    if is_masked_lm(checkpoint.get("hyper_parameters")):
        raise ConfigError(
            f"model.init_from={path} is a masked-LM pretraining checkpoint: it starts a classifier "
            "(experiment=sst2), not a translation model"
        )
    try:
        theirs = task_of(checkpoint, path)
    except CheckpointError as err:
        raise ConfigError(f"model.init_from: {err}") from None
    if theirs != kind:
        starts = (
            "a translation checkpoint (trained here, or imported with aiayn-import)"
            if kind == "translation"
            else "a masked-LM (experiment=sst2_pretrain) or a classification checkpoint"
        )
        raise ConfigError(
            f"model.init_from={path} is a {theirs} checkpoint: a {kind} run starts from {starts}"
        )


def _take_pooling(cfg: DictConfig, saved: str, source: str, explicit: set[str]) -> None:
    ours = cfg.model.get("pooling")
    if "model.pooling" in explicit and ours != saved:
        raise ConfigError(
            f"model.pooling={ours} contradicts {source} ({saved}): its pooler's weights belong to it; "
            "leave model.pooling unset"
        )
    with open_dict(cfg):
        cfg.model.pooling = saved


def _check_languages(cfg: DictConfig, checkpoint: Mapping[str, Any], path: str) -> None:
    saved = (checkpoint.get("config") or {}).get("data") or {}
    check_languages(saved, cfg.data, f"model.init_from={path}", "fine-tune it on data in its languages")


def check_languages(saved: Mapping[str, Any], given: Mapping[str, Any], source: str, then: str) -> None:
    """A ConfigError naming both pairs if `given`'s data.src_lang / data.tgt_lang (an override, a run's
    data config) contradict the languages of `source`'s saved data config `saved` (its model translates
    those: another pair decodes nonsense). A checkpoint without languages (an import whose tokenizer
    config names none: "src" / "tgt") contradicts nothing."""
    known = {key: saved.get(key) for key in ("src_lang", "tgt_lang") if saved.get(key) not in (None, key[:3])}
    wrong = [key for key in known if given.get(key) is not None and given.get(key) != known[key]]
    if wrong:
        asked = " ".join(f"data.{key}={given.get(key)}" for key in wrong)
        raise ConfigError(
            f"{asked} but {source} translates {saved.get('src_lang')} -> {saved.get('tgt_lang')}: {then}"
        )


def _take_config(cfg: DictConfig, saved: dict[str, Any], source: str, explicit: set[str]) -> None:
    node = cfg.model.get("config")
    if node is not None and not OmegaConf.is_dict(node):
        raise ConfigError(f"model.config must be a mapping of the model's settings, got {node!r}")
    # an empty node is falsy, and OmegaConf.to_container refuses a plain {}: no `or {}` here
    ours = OmegaConf.to_container(node, resolve=True) if node is not None else {}
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
