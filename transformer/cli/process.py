"""Process-wide switches of a training run: threads, the allocator, matmul precision, the local rank."""

from __future__ import annotations

import ctypes
import os
import sys

import lightning as L
import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from omegaconf import DictConfig

from transformer.cli.errors import ConfigError


def set_process_switches(cfg: DictConfig) -> None:
    if cfg.get("matmul_precision") and cfg.matmul_precision not in ("highest", "high", "medium"):
        raise ConfigError(f"matmul_precision must be highest, high or medium, got {cfg.matmul_precision!r}")
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    if cfg.get("tune_malloc"):
        _tune_malloc()


def set_matmul_precision(cfg: DictConfig, trainer: L.Trainer) -> None:
    """A GPU switch (TF32 matmuls): on the CPU, "high" made training steps 2x slower and memory grow
    with every new batch shape (oneDNN's lower-precision path), so CPU runs keep torch's default."""
    if cfg.get("matmul_precision") and isinstance(trainer.accelerator, CUDAAccelerator):
        torch.set_float32_matmul_precision(cfg.matmul_precision)


def _tune_malloc() -> None:
    """glibc: serve large tensors from the heap and never trim it, so that the big activation buffers
    are reused across steps instead of being unmapped and page-faulted in again."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return
    m_trim_threshold, m_mmap_max = -1, -4  # from <malloc.h>
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 2**31 - 1)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
