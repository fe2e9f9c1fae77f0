"""Every value a user can set in configs/data, configs/model and configs/trainer is checked before
anything runs, with a message naming its key, or is harmless: a wrong type, a negative number and a
zero for each key, through the checks and builders `train.py` runs before training."""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from tests.helpers.configs import compose_train_cfg, fake_data_fields, pretend_cuda
from tests.helpers.repo import REPO_ROOT
from transformer.cli import build, checks, errors
from transformer.cli.errors import ConfigError

CONFIGS = REPO_ROOT / "configs"
# each config file, with the experiment that uses it
FILES = {
    ("data", "synthetic"): [],
    ("data", "multi30k"): ["experiment=multi30k_de_en"],
    ("data", "sst2"): ["experiment=sst2"],
    ("data", "iwslt14"): ["experiment=iwslt14_de_en"],
    ("data", "wmt14"): ["experiment=wmt14_en_de_base"],
    ("model", "translation"): [],
    ("model", "classification"): ["experiment=sst2"],
    ("model", "masked_lm"): ["experiment=sst2_pretrain"],
    ("trainer", "default"): [],
    ("trainer", "cpu"): ["trainer=cpu"],
    ("trainer", "gpu"): ["trainer=gpu"],
    ("trainer", "ddp"): ["trainer=ddp"],
    ("trainer", "ddp_cpu"): ["trainer=ddp_cpu"],
}
CUDA_TRAINERS = ("trainer=gpu", "trainer=ddp")  # instantiated with Lightning shown 2 CUDA devices
HOSTILE = ("oops", -1, 0)

# Values that pass these checks on purpose, and why they are harmless (or caught later in one line).
HARMLESS: dict[str, str] = {
    "data.src_lang=oops": "a language code: the synthetic task ignores it; files named by it are looked up "
    "when the data is read (DataError: one line, test_multi30k_missing_file_lists_present_splits)",
    "data.tgt_lang=oops": "as data.src_lang",
    "data.data_dir=oops": "a directory looked up when the data is read (DataError: one line, "
    "test_missing_directory_names_path_and_layout)",
    "data.train_split=oops": "a split looked up when the data is read (DataError: one line, "
    "test_multi30k_hub_maps_split_names)",
    "data.val_split=oops": "as data.train_split",
    "data.test_split=oops": "as data.train_split",
    "data.hub_name=oops": "a hub dataset looked up when the data is read (DataError: one line, "
    "test_hub_dataset_that_cannot_be_loaded_is_one_data_error)",
    "data.hub_config=oops": "as data.hub_name",
    "data.hub_split_names.val=oops": "as data.train_split (the split's name on the hub)",
    "data.num_workers=0": "batches are made in the main process",
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
    "trainer.devices=-1": "every visible GPU",
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
    "trainer.limit_train_batches=0": "no training batches (Lightning's meaning), as trainer.max_steps=0",
    "trainer.limit_val_batches=0": "no validation (Lightning's meaning, the usual way to switch it off)",
    "trainer.limit_test_batches=0": "no test batches (Lightning's meaning), as test=false",
}


def _leaves(node: dict[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if key in ("defaults", "_target_", "_partial_"):
            continue
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _hostile_values(default: Any) -> Iterator[Any]:
    """HOSTILE for the whole value; for a list also each element of it replaced by each HOSTILE value."""
    yield from (value for value in HOSTILE if value != default)
    if isinstance(default, list):
        for i, element in enumerate(default):
            if not isinstance(element, dict):  # a list of objects (trainer.plugins) is replaced whole
                yield from ([*default[:i], value, *default[i + 1 :]] for value in HOSTILE if value != element)


def _cases() -> Iterator[Any]:
    for (group, name), base in FILES.items():
        node = yaml.safe_load((CONFIGS / group / f"{name}.yaml").read_text())
        for key, default in _leaves(node, f"{group}."):
            for value in _hostile_values(default):
                yield pytest.param(base, key, value, id=f"{name}:{_override(key, value)}")


def _override(key: str, value: Any) -> str:
    """`KEY=VALUE` as it is typed on the command line (a list as [a,b])."""
    if isinstance(value, list):
        return f"{key}=[{','.join(str(v) for v in value)}]"
    return f"{key}={value}"


def _build(cfg: DictConfig, group: str) -> None:
    """What train.py checks and builds for `group` before it reads any data or trains."""
    checks.check_config(cfg)
    if group == "data":
        build.instantiate(cfg.data, "data")
    elif group == "model":
        fake_data_fields(cfg)
        task = build.instantiate(cfg.model, "model")
        build.check_optimizer(task)
    else:
        callbacks = build.instantiate_group(cfg.get("callbacks"), "callbacks")
        build.instantiate(cfg.trainer, "trainer", callbacks=callbacks, logger=False)


@functools.cache
def _composed(base: tuple[str, ...]) -> DictConfig:
    """The config of `base`, without its `hydra` node (`${hydra:...}` resolves through Hydra's runtime
    config, which compose_train_cfg sets; no check reads the node): half of it, and each case copies it."""
    cfg = compose_train_cfg(list(base), output_dir=Path("/nonexistent/run"))
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


# a small network, so that building one per case is quick (a case's own key replaces these)
SMALL = {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "d_ff": 64}


@pytest.mark.parametrize(("base", "key", "value"), list(_cases()))
def test_a_hostile_value_is_refused_naming_its_key_or_is_harmless(
    base: list[str], key: str, value: Any
) -> None:
    override = _override(key, value)
    cfg = copy.deepcopy(_composed(tuple(base)))  # what `KEY=VALUE` on the command line makes of it
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, merge=False)
        for name, size in SMALL.items():
            if f"model.config.{name}" != key:
                cfg.model.config[name] = size
    try:
        with (
            pretend_cuda(2) if set(base) & set(CUDA_TRAINERS) else contextlib.nullcontext(),
            mock.patch.object(checks, "_gpu_available", lambda: True),  # experiments that pick a GPU trainer
        ):
            _build(cfg, key.split(".", 1)[0])
    except ConfigError as err:
        assert key.rsplit(".", 1)[-1] in str(err), f"{override}: the message does not name the key: {err}"
        assert "\n" not in str(err)
        return
    assert override in HARMLESS, (
        f"{override} passes every check: check it, or explain in HARMLESS why it is fine"
    )


def test_every_harmless_value_is_still_a_case() -> None:
    cases = {_override(p.values[1], p.values[2]) for p in _cases()}
    assert set(HARMLESS) <= cases, sorted(set(HARMLESS) - cases)


def test_every_test_a_harmless_reason_names_exists() -> None:
    """A reason that points at a test (test_...) points at one that is in the suite."""
    defined = set(re.findall(r"^def (test_\w+)", _all_tests(), flags=re.M))
    named = {name for reason in HARMLESS.values() for name in re.findall(r"\btest_\w+", reason)}
    assert named and named <= defined, sorted(named - defined)


def _all_tests() -> str:
    return "\n".join(path.read_text() for path in (REPO_ROOT / "tests").rglob("test_*.py"))


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"], ids=["accelerator_gpu", "accelerator_cuda"])
def test_a_gpu_trainer_without_a_gpu_is_refused_before_any_work(
    monkeypatch: pytest.MonkeyPatch, accelerator: str
) -> None:
    cfg = compose_train_cfg(["trainer=gpu", f"trainer.accelerator={accelerator}"])
    monkeypatch.setattr(checks, "_gpu_available", lambda: False)
    with pytest.raises(ConfigError, match=rf"trainer.accelerator={accelerator} needs a GPU.*trainer=default"):
        checks.check_config(cfg)
    monkeypatch.setattr(checks, "_gpu_available", lambda: True)
    checks.check_config(cfg)  # with a GPU: fine


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "+trainer.max_epoch=1",
            r"^trainer.max_epoch is not an argument of Trainer \(did you mean trainer.max_epochs\?\)$",
        ),
        ("+trainer.limit_val_batchs=2", r"did you mean trainer.limit_val_batches\?"),
        (
            "+trainer.zzz=1",
            r"^trainer.zzz is not an argument of Trainer \(see configs/trainer/default.yaml\)$",
        ),
    ],
)
def test_a_misspelled_trainer_key_is_refused_before_any_work(override: str, message: str) -> None:
    """Hydra's own hint for `trainer.max_epoch=1` is `+trainer.max_epoch=1`; the Trainer would refuse it
    only after the data is prepared (issue 51: a TypeError traceback)."""
    with pytest.raises(ConfigError, match=message):
        checks.check_config(compose_train_cfg([override]))


def test_every_trainer_key_of_the_configs_is_a_trainer_argument() -> None:
    for name, base in FILES.items():
        if name[0] == "trainer":
            checks.check_trainer_keys(_composed(tuple(base)))
    for preset in sorted(p.stem for p in (CONFIGS / "debug").glob("*.yaml")):
        checks.check_trainer_keys(compose_train_cfg([f"debug={preset}"]))
    for experiment in sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml")):
        checks.check_trainer_keys(compose_train_cfg([f"experiment={experiment}"]))


@pytest.mark.parametrize(
    ("key", "printed"),
    [
        (
            "trainer.max_epoch",
            "trainer.max_epoch is not an argument of Trainer (did you mean trainer.max_epochs?)",
        ),
        ("trainer.fast_dev_run", "Could not override 'trainer.fast_dev_run'. To append to your config use +"),
        ("trainer.zzz", "Could not override 'trainer.zzz'. To append to your config use +"),
    ],
)
def test_hydras_plus_hint_for_a_misspelled_trainer_key_becomes_the_key_meant(
    monkeypatch: pytest.MonkeyPatch, key: str, printed: str
) -> None:
    """`+` is Hydra's advice for any key the config lacks: right for a Trainer argument the config does
    not set, wrong for a misspelled one."""

    def hydra_main() -> None:
        compose_train_cfg([f"{key}=1"])

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # errors.run sets it: undone after the test
    with pytest.raises(SystemExit) as raised:
        errors.run(hydra_main, CONFIGS, lambda err: None)
    assert str(raised.value).startswith(f"error: {printed}") and "\n" not in str(raised.value)


@pytest.mark.parametrize("value", ["00:12:00:00", "{hours: 12}", "{days: 1, minutes: 30}", "null"])
def test_max_time_takes_what_lightnings_timer_reads(value: str) -> None:
    checks.check_max_time(compose_train_cfg([f"trainer.max_time={value}"]))


@pytest.mark.parametrize("value", ["12:00", "'00:12:00:xx'", "{hour: 12}", "{hours: -1}", "'{}'", "3600"])
def test_max_time_otherwise_is_one_line_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^`trainer.max_time` must be DD:HH:MM:SS"):
        checks.check_max_time(compose_train_cfg([f"trainer.max_time={value}"]))
