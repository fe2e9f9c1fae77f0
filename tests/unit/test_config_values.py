"""Every value a user can set in configs/data, configs/model and configs/trainer is checked before
anything runs, with a message naming its key, or is harmless: a wrong type, a negative number and a
zero for each key, through the checks and builders `train.py` runs before training."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from tests.conftest import REPO_ROOT
from tests.unit.test_configs import _fake_data_fields, compose_train_cfg
from transformer.cli import build, checks
from transformer.cli.errors import ConfigError

CONFIGS = REPO_ROOT / "configs"
# each config file, with the experiment that uses it
FILES = {
    ("data", "synthetic"): [],
    ("data", "multi30k"): ["experiment=multi30k_de_en"],
    ("data", "sst2"): ["experiment=sst2"],
    ("model", "translation"): [],
    ("model", "classification"): ["experiment=sst2"],
    ("model", "masked_lm"): ["experiment=sst2_pretrain"],
    ("trainer", "default"): [],
}
HOSTILE = ("oops", -1, 0)

# Values that pass these checks on purpose, and why they are harmless (or caught later in one line).
HARMLESS: dict[str, str] = {
    "data.src_lang=oops": "a language code: the synthetic task ignores it; files named by it are looked up "
    "when the data is read (DataError: one line, test_data_values_that_only_the_files_can_refuse)",
    "data.tgt_lang=oops": "as data.src_lang",
    "data.data_dir=oops": "a directory looked up when the data is read (DataError: one line)",
    "data.train_split=oops": "a split looked up when the data is read (DataError: one line)",
    "data.val_split=oops": "as data.train_split",
    "data.test_split=oops": "as data.train_split",
    "data.cache_dir=oops": "a relative directory, created where the run starts",
    "data.min_frequency=0": "every pair of symbols may be merged",
    "data.seed=0": "a seed",
    "model.config.dropout=0": "no dropout",
    "model.label_smoothing=0": "plain cross entropy",
    "model.mask_prob=0": "masks nothing: loss 0 (the masked-LM task handles empty batches)",
    "model.init_from=oops": "a checkpoint path, read before training (CheckpointError: one line)",
    "model.optimizer.weight_decay=0": "no weight decay",
    "model.scheduler.warmup_steps=0": "cosine_with_warmup: no warmup",
    "model.decoding.length_penalty=-1": "a length penalty may favour short hypotheses",
    "model.decoding.length_penalty=0": "no length normalization",
    "model.decoding.max_len_a=0": "hypotheses of at most max_len_b tokens",
    "model.decoding.max_len_b=0": "hypotheses of at most max_len_a * source length tokens",
    "trainer.default_root_dir=oops": "a relative directory (the loggers write into paths.output_dir)",
    "trainer.min_epochs=-1": "no minimum",
    "trainer.min_epochs=0": "no minimum",
    "trainer.max_epochs=-1": "no epoch limit (max_steps ends the run)",
    "trainer.max_epochs=0": "no training (then testing)",
    "trainer.max_steps=0": "no training (then testing)",
    "trainer.gradient_clip_val=0": "no clipping",
    "trainer.num_sanity_val_steps=-1": "the whole validation set as the sanity check",
    "trainer.num_sanity_val_steps=0": "no sanity check",
    "trainer.log_every_n_steps=-1": "Lightning logs at epoch ends only",
    "trainer.log_every_n_steps=0": "as -1",
}


def _leaves(node: dict[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if key in ("defaults", "_target_", "_partial_"):
            continue
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        elif not isinstance(value, list):
            yield f"{prefix}{key}", value


def _cases() -> Iterator[Any]:
    for (group, name), base in FILES.items():
        node = yaml.safe_load((CONFIGS / group / f"{name}.yaml").read_text())
        for key, default in _leaves(node, f"{group}."):
            for value in HOSTILE:
                if value != default:
                    yield pytest.param(base, key, value, id=f"{name}:{key}={value}")


def _build(cfg: DictConfig, group: str) -> None:
    """What train.py checks and builds for `group` before it reads any data or trains."""
    checks.check_config(cfg)
    if group == "data":
        build.instantiate(cfg.data, "data")
    elif group == "model":
        _fake_data_fields(cfg)
        task = build.instantiate(cfg.model, "model")
        build.check_optimizer(task)
    else:
        callbacks = build.instantiate_group(cfg.get("callbacks"), "callbacks")
        build.instantiate(cfg.trainer, "trainer", callbacks=callbacks, logger=False)


@functools.cache
def _composed(base: tuple[str, ...]) -> DictConfig:
    return compose_train_cfg(list(base), output_dir=Path("/nonexistent/run"))


# a small network, so that building one per case is quick (a case's own key replaces these)
SMALL = {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "d_ff": 64}


@pytest.mark.parametrize(("base", "key", "value"), list(_cases()))
def test_a_hostile_value_is_refused_naming_its_key_or_is_harmless(
    base: list[str], key: str, value: Any
) -> None:
    override = f"{key}={value}"
    cfg = copy.deepcopy(_composed(tuple(base)))  # what `KEY=VALUE` on the command line makes of it
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, merge=False)
        for name, size in SMALL.items():
            if f"model.config.{name}" != key:
                cfg.model.config[name] = size
    try:
        _build(cfg, key.split(".", 1)[0])
    except ConfigError as err:
        assert key.rsplit(".", 1)[-1] in str(err), f"{override}: the message does not name the key: {err}"
        assert "\n" not in str(err)
        return
    assert override in HARMLESS, (
        f"{override} passes every check: check it, or explain in HARMLESS why it is fine"
    )


def test_every_harmless_value_is_still_a_case() -> None:
    cases = {f"{p.values[1]}={p.values[2]}" for p in _cases()}
    assert set(HARMLESS) <= cases, sorted(set(HARMLESS) - cases)
