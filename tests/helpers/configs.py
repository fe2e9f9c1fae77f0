"""Composing configs/train.yaml as train.py does; standing in for what a run needs (data, CUDA devices)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from tests.helpers.repo import REPO_ROOT

CONFIGS = REPO_ROOT / "configs"


def compose_train_cfg(overrides: Sequence[str] = (), output_dir: Path | None = None) -> DictConfig:
    """configs/train.yaml as `python train.py OVERRIDES` composes it, with the run directory at `output_dir`.

    Sets PROJECT_ROOT (train.py's main does it too) and Hydra's runtime config, so `${hydra:...}` resolves.
    """
    os.environ.setdefault("PROJECT_ROOT", str(REPO_ROOT))
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIGS)):
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    if output_dir is not None:
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(output_dir)
            cfg.hydra.job.name = "train"
    HydraConfig.instance().set_config(cfg)
    return cfg


def fake_data_fields(cfg: DictConfig) -> None:
    """What train.py reads from a prepared datamodule, without loading any data."""
    with open_dict(cfg):
        cfg.model.config.update(src_vocab_size=64, tgt_vocab_size=64, pad_id=0, bos_id=1, eos_id=2)
        if cfg.model._target_.endswith("ClassificationTask"):
            cfg.model.num_classes = 2


@contextmanager
def pretend_cuda(count: int) -> Iterator[None]:
    """Lightning sees `count` CUDA devices, so the gpu/ddp trainer configs instantiate on a CPU machine."""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import lightning.pytorch.accelerators.cuda as pytorch_cuda

    with (
        mock.patch.object(fabric_cuda, "num_cuda_devices", lambda: count),
        mock.patch.object(pytorch_cuda, "num_cuda_devices", lambda: count),
        mock.patch.object(fabric_cuda, "is_cuda_available", lambda: True),
        mock.patch("torch.cuda.is_available", lambda: True),
        mock.patch("torch.cuda.device_count", lambda: count),
    ):
        yield
