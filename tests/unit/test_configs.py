"""Every Hydra config composes, paths come out absolute, and its objects instantiate (no data, no network)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import hydra
import lightning as L
import pytest
import yaml
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from tests.helpers.configs import CONFIGS, compose_train_cfg, fake_data_fields, pretend_cuda
from tests.helpers.repo import REPO_ROOT
from transformer.search.decoding import DecodingSettings

EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
GPU_EXPERIMENTS = {"iwslt14_de_en", "wmt14_en_de_base"}
# fine-tuning an imported model: lr, warmup share of the run's steps, epochs, logger (docs/pretrained.md)
FINETUNE_PRESETS = {"finetune_opus_mt": (5e-5, 0.05, 3), "finetune_bert_sst2": (2e-5, 0.06, 3)}


@pytest.fixture
def fresh_hydra() -> Iterator[None]:
    yield
    GlobalHydra.instance().clear()


def _instantiate_all(cfg: DictConfig) -> tuple[object, ...]:
    datamodule = hydra.utils.instantiate(cfg.data, _convert_="all")
    fake_data_fields(cfg)
    task = hydra.utils.instantiate(cfg.model, _convert_="all")
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    return datamodule, task, callbacks, loggers, trainer


def test_default_run_is_the_quickstart(fresh_hydra, tmp_path) -> None:
    cfg = compose_train_cfg(output_dir=tmp_path)
    assert cfg.data.source == "synthetic" and "quickstart" in cfg.tags
    assert cfg.train and cfg.test and cfg.ckpt_path is None
    assert cfg.logger is not None and set(cfg.logger) == {"csv"}  # no account, no server, no network
    assert cfg.model.config.d_model < 512  # a CPU-sized model, not the paper's base


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_instantiates(fresh_hydra, tmp_path, experiment: str) -> None:
    overrides = [f"experiment={experiment}", "logger.wandb.save_dir=" + str(tmp_path)]
    if "wandb" not in (CONFIGS / "experiment" / f"{experiment}.yaml").read_text():
        overrides = overrides[:1]
    if experiment in GPU_EXPERIMENTS:  # the same objects, built on this CPU-only machine
        overrides += ["trainer.accelerator=cpu", "trainer.devices=1", "model.compile=false"]
    if experiment in FINETUNE_PRESETS:  # model.init_from is mandatory (???): the task only stores it here
        overrides.append(f"model.init_from={tmp_path / 'imported' / 'model.ckpt'}")
    cfg = compose_train_cfg(overrides, output_dir=tmp_path)
    resolved = OmegaConf.to_container(
        OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True
    )
    assert resolved["paths"]["output_dir"] == str(tmp_path)
    datamodule, task, _, _, trainer = _instantiate_all(cfg)
    assert isinstance(datamodule, L.LightningDataModule) and isinstance(task, L.LightningModule)
    assert isinstance(trainer, L.Trainer)
    assert cfg.optimized_metric.startswith("val/")
    monitor = cfg.callbacks.model_checkpoint.monitor
    expected = {"sst2": "val/acc", "sst2_pretrain": "val/loss", "finetune_bert_sst2": "val/acc"}.get(
        experiment, "val/bleu"
    )
    assert monitor == expected
    assert trainer.checkpoint_callback is not None and trainer.checkpoint_callback.monitor == monitor


# ids spelled out: a bare "gpu" id would match the `gpu` marker's keyword and skip the test on CPU
@pytest.mark.parametrize("trainer", ["default", "cpu", "gpu", "ddp", "ddp_cpu"], ids=lambda t: f"trainer={t}")
def test_trainer_configs(fresh_hydra, tmp_path, trainer: str) -> None:
    cfg = compose_train_cfg([f"trainer={trainer}"], output_dir=tmp_path)
    assert cfg.trainer.use_distributed_sampler is False  # the datamodules shard their own batches
    if trainer in ("gpu", "ddp"):
        assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "bf16-mixed"
    with pretend_cuda(2) if trainer in ("gpu", "ddp") else nullcontext():
        built = hydra.utils.instantiate(cfg.trainer, logger=False)  # no process group starts here
    if trainer in ("gpu", "ddp"):
        assert type(built.accelerator).__name__ == "CUDAAccelerator" and built.precision == "bf16-mixed"
        expected = ("SingleDeviceStrategy", 1) if trainer == "gpu" else ("DDPStrategy", 2)  # -1 = all
        assert (type(built.strategy).__name__, built.num_devices) == expected
    if trainer == "ddp_cpu":
        assert built.num_devices == 2 and type(built.strategy).__name__ == "DDPStrategy"
        assert built.strategy._process_group_backend == "gloo"


# Lightning keys users expect to override plainly (`trainer.limit_val_batches=2`, no `+`); the project's
# own choices, which differ from Lightning's defaults on purpose, are in PROJECT_CHOICES
COMMON_TRAINER_KEYS = {
    "max_steps": 5, "max_time": "00:00:05:00", "limit_train_batches": 2, "limit_val_batches": 2,
    "limit_test_batches": 0.5, "val_check_interval": 0.5, "num_sanity_val_steps": 0, "log_every_n_steps": 5,
    "accumulate_grad_batches": 2, "gradient_clip_val": 0.5, "precision": "bf16-mixed", "deterministic": True,
}  # fmt: skip
PROJECT_CHOICES = {
    "max_epochs": 10, "min_epochs": 1, "devices": 1, "precision": "32-true", "gradient_clip_val": 1.0,
    "num_sanity_val_steps": 1, "log_every_n_steps": 10, "deterministic": False,
    "use_distributed_sampler": False, "gradient_clip_algorithm": "norm",
}  # fmt: skip


def test_common_trainer_keys_override_without_plus_and_keep_lightnings_defaults(
    fresh_hydra, tmp_path
) -> None:
    """Each key of COMMON_TRAINER_KEYS is in configs/trainer/default.yaml, at Lightning's default unless
    the project chose otherwise, so that listing it changed no run (issue 51)."""
    cfg = compose_train_cfg([f"trainer.{k}={v}" for k, v in COMMON_TRAINER_KEYS.items()], output_dir=tmp_path)
    assert {key: cfg.trainer[key] for key in COMMON_TRAINER_KEYS} == COMMON_TRAINER_KEYS
    defaults = yaml.safe_load((CONFIGS / "trainer" / "default.yaml").read_text())
    lightning = inspect.signature(L.Trainer.__init__).parameters
    for key, value in defaults.items():
        if key in lightning and key not in ("default_root_dir", "plugins"):
            assert value == PROJECT_CHOICES.get(key, lightning[key].default), key


@pytest.mark.parametrize("logger", ["csv", "wandb", "tensorboard", "many_loggers"])
def test_logger_configs(fresh_hydra, tmp_path, logger: str) -> None:
    cfg = compose_train_cfg([f"logger={logger}"], output_dir=tmp_path)
    built = [hydra.utils.instantiate(c) for c in cfg.logger.values()]
    assert built and all(lg.save_dir.startswith(str(tmp_path)) for lg in built)
    if "wandb" in cfg.logger:
        assert cfg.logger.wandb.offline is True  # works without an account or network by default


@pytest.mark.parametrize("debug", ["fdr", "limit", "overfit", "profiler"])
def test_debug_configs(fresh_hydra, tmp_path, debug: str) -> None:
    cfg = compose_train_cfg([f"debug={debug}"], output_dir=tmp_path)
    assert cfg.task_name == "debug" and cfg.logger is None and cfg.trainer.accelerator == "cpu"
    _instantiate_all(cfg)


def test_callbacks_none(fresh_hydra, tmp_path) -> None:
    cfg = compose_train_cfg(["callbacks=none"], output_dir=tmp_path)
    assert not cfg.callbacks


def test_default_callbacks_keep_best_and_last(fresh_hydra, tmp_path) -> None:
    cfg = compose_train_cfg(output_dir=tmp_path)
    _, _, callbacks, _, _ = _instantiate_all(cfg)
    names = {type(c).__name__ for c in callbacks}
    assert {"ModelCheckpoint", "EarlyStopping", "LearningRateMonitor", "RichProgressBar"} <= names
    best, last = (c for c in callbacks if type(c).__name__ == "ModelCheckpoint")
    assert (best.monitor, best.mode, last.monitor, last.filename) == ("val/bleu", "max", None, "last")
    assert best.dirpath == last.dirpath == str(tmp_path / "checkpoints")


def test_progress_bar_off_drops_the_bar_callback(fresh_hydra, tmp_path) -> None:
    """`trainer.enable_progress_bar=false` with the default callbacks: Lightning refuses a Trainer that has
    the bar off and a bar among its callbacks, so the bar callback is dropped, as the user asked."""
    from transformer.cli.build import build_trainer

    cfg = compose_train_cfg(["++trainer.enable_progress_bar=false"], output_dir=tmp_path)
    assert "rich_progress_bar" in cfg.callbacks
    trainer = build_trainer(cfg, checkpoint=None)
    assert trainer.progress_bar_callback is None
    assert "ModelCheckpoint" in {type(c).__name__ for c in trainer.callbacks}
    on = build_trainer(compose_train_cfg(output_dir=tmp_path), checkpoint=None)
    assert type(on.progress_bar_callback).__name__ == "RichProgressBar"


def test_paths_are_absolute_from_any_working_directory(fresh_hydra, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = compose_train_cfg(output_dir=tmp_path / "run")
    for key in ("root_dir", "cache_dir", "log_dir", "output_dir"):
        assert Path(cfg.paths[key]).is_absolute(), key
    assert Path(cfg.paths.root_dir) == REPO_ROOT
    assert Path(cfg.data.cache_dir).is_relative_to(REPO_ROOT / ".cache")  # gitignored
    assert cfg.hydra.job.chdir is False
    assert cfg.hydra.run.dir.startswith(str(REPO_ROOT / "logs" / "train" / "runs"))


def test_architecture_keys_live_under_model_config(fresh_hydra, tmp_path) -> None:
    from transformer.config import TransformerConfig

    cfg = compose_train_cfg(["model.config.d_model=96", "model.config.n_heads=3"], output_dir=tmp_path)
    fake_data_fields(cfg)
    config = TransformerConfig.from_dict(OmegaConf.to_container(cfg.model.config))
    assert (config.d_model, config.n_heads) == (96, 3)


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONFIGS / "decode").glob("*.yaml")))
def test_every_decode_config_is_a_decoding_settings(name: str) -> None:
    """configs/decode/ sets the fields of the one decoding-settings type (null: the checkpoint's own)."""
    values = OmegaConf.to_container(OmegaConf.load(CONFIGS / "decode" / f"{name}.yaml"))
    assert set(values) == set(DecodingSettings())
    DecodingSettings.from_values(values, prefix="decode.")


def test_the_model_configs_decode_with_the_types_defaults() -> None:
    """The translation model's validation decoding in configs/ is DecodingSettings' defaults, spelled out."""
    model = OmegaConf.load(CONFIGS / "model" / "translation.yaml")
    assert DecodingSettings.from_values(OmegaConf.to_container(model.decoding)) == DecodingSettings()


@pytest.mark.parametrize("experiment", sorted(FINETUNE_PRESETS))
def test_finetune_presets_schedule_a_pretrained_start(fresh_hydra, tmp_path, experiment: str) -> None:
    """A low peak lr reached after a short warmup (a share of the run's steps), then a straight line down
    to 0; few epochs; the csv logger alone (no wandb run, no warning about an anonymous one)."""
    import torch

    lr, share, epochs = FINETUNE_PRESETS[experiment]
    init = f"model.init_from={tmp_path / 'model.ckpt'}"
    cfg = compose_train_cfg([f"experiment={experiment}", init], output_dir=tmp_path)
    assert cfg.trainer.max_epochs == epochs and set(cfg.logger) == {"csv"}
    assert cfg.model.optimizer.lr == lr and cfg.model.init_from == str(tmp_path / "model.ckpt")
    factory = hydra.utils.instantiate(cfg.model.scheduler)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = factory(optimizer, total_steps=1000)
    rates = []
    for _ in range(1000):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    warmup = round(share * 1000)
    assert rates[warmup - 1] == pytest.approx(lr) and max(rates) == pytest.approx(lr)
    assert rates[0] == pytest.approx(lr / warmup)
    assert rates[warmup + (1000 - warmup) // 2 - 1] == pytest.approx(lr / 2)  # halfway down the line
    assert rates[-2] == pytest.approx(lr / (1000 - warmup)) and rates[-1] == 0.0  # 0 at the last step
