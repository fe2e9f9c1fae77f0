"""Checkpoint files: safe loading (never unpickles code), averaging, and the compile-prefix fix-up;
the EMA callback whose averaged weights are the ones a checkpoint is evaluated with.

Every checkpoint this project reads goes through `load_checkpoint`, which uses
`torch.load(weights_only=True)`: a file that would run code when unpickled is refused.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

COMPILE_PREFIX = "_orig_mod."


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, unsafe or not the kind that was expected."""


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint dict with `weights_only=True`, turning every failure into one clear line."""
    path = Path(path)
    if not path.is_file():
        what = f"is a directory, not a file: {files_in_hint(path)}" if path.is_dir() else "does not exist"
        raise CheckpointError(f"checkpoint {path} {what}")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        # weights_only refuses any global that is not a tensor/primitive type: this is where a
        # planted `__reduce__` payload ends up, before anything is executed.
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"refusing to load checkpoint {path}: it contains Python objects that would run code when "
            f"unpickled (only tensors and plain data are accepted): {first_line}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupt ({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {path} is not a training checkpoint (no 'state_dict' entry)")
    return checkpoint


def files_in_hint(directory: Path) -> str:
    """What to give instead of `directory` where a checkpoint file is wanted: its `last.ckpt` (or its
    `checkpoints/last.ckpt`, for a run directory), else the checkpoints it holds."""
    for folder in (directory, directory / "checkpoints"):
        if (folder / "last.ckpt").is_file():
            return f"give a .ckpt file, e.g. {folder / 'last.ckpt'}"
        found = sorted(p.name for p in folder.glob("*.ckpt") if p.is_file()) if folder.is_dir() else []
        if found:
            shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
            return f"give one of the .ckpt files in {folder}: {shown}"
    return f"give a .ckpt file (there is none in {directory}, nor in a checkpoints/ folder under it)"


def strip_compile_prefix(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Drop the `_orig_mod.` segment that `torch.compile` inserts into parameter names."""
    return {key.replace(COMPILE_PREFIX, ""): value for key, value in state_dict.items()}


def state_dict_mismatch(expected: Mapping[str, Tensor], actual: Mapping[str, Tensor]) -> str | None:
    """How the tensors `actual` differ from `expected` in names or shapes (None when they fit)."""
    missing, unexpected = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing or unexpected:
        return f"missing {missing[:3]}, unexpected {unexpected[:3]}"
    for key, value in actual.items():
        if value.shape != expected[key].shape:
            return f"{key} has shape {tuple(value.shape)}, expected {tuple(expected[key].shape)}"
    return None


def average_checkpoints(paths: Sequence[str | Path]) -> dict[str, Any]:
    """Average the weights of several checkpoints of one run (Vaswani et al. 2017, section 6.1).

    Floating-point tensors are averaged in float64 and cast back; integer buffers (step counters)
    are taken from the last checkpoint. The other entries (config, tokenizers) come from the last
    checkpoint, so the result loads wherever the last one does.
    """
    if not paths:
        raise CheckpointError("average_checkpoints needs at least one checkpoint path")
    checkpoints = [load_checkpoint(p) for p in paths]
    reference = checkpoints[-1]["state_dict"]
    sums: dict[str, Tensor] = {}
    for path, checkpoint in zip(paths, checkpoints):
        state_dict = checkpoint["state_dict"]
        mismatch = state_dict_mismatch(reference, state_dict)
        if mismatch:
            raise CheckpointError(
                f"cannot average {path}: its parameters differ from {paths[-1]} ({mismatch})"
            )
        for key, value in state_dict.items():
            if value.is_floating_point():
                sums[key] = sums.get(key, 0) + value.double()
    averaged = dict(checkpoints[-1])
    averaged["state_dict"] = {
        key: (sums[key] / len(checkpoints)).to(value.dtype) if key in sums else value
        for key, value in reference.items()
    }
    averaged["averaged_from"] = [str(p) for p in paths]
    return averaged
