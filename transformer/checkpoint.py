"""Checkpoint files: safe loading (never unpickles code), averaging, and the compile-prefix fix-up;
the EMA callback whose averaged weights are the ones a checkpoint is evaluated with.

Every checkpoint this project reads goes through `load_checkpoint`, which uses
`torch.load(weights_only=True)`: a file that would run code when unpickled is refused.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

COMPILE_PREFIX = "_orig_mod."


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, unsafe or not the kind that was expected."""


# what torch.load raises on an empty, truncated or random file besides UnpicklingError: the zip reader's
# errors, and the unpickler's own IndexError (pop from an empty stack), KeyError (an unknown memo id),
# UnicodeDecodeError, struct.error, ...
_DAMAGED = (
    RuntimeError,
    EOFError,
    zipfile.BadZipFile,
    OSError,
    ValueError,
    LookupError,
    struct.error,
    TypeError,
)


def _zip(path: Path) -> bool:
    """Whether `path` is in torch.save's zip format (the one torch.load can memory-map)."""
    return zipfile.is_zipfile(path)


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, mmap: bool = False
) -> dict[str, Any]:
    """Load a checkpoint dict with `weights_only=True`, turning every failure into one clear line; `mmap`:
    tensors memory-mapped, not read (the zip format torch.save writes; an older file is read whole)."""
    path = Path(path)
    if not path.is_file():
        what = f"is a directory, not a file: {files_in_hint(path)}" if path.is_dir() else "does not exist"
        raise CheckpointError(f"checkpoint {path} {what}")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and _zip(path))
    except pickle.UnpicklingError as err:
        # weights_only refuses any global that is not a tensor/primitive type: this is where a
        # planted `__reduce__` payload ends up, before anything is executed. Random bytes and a raw pickle
        # of protocol 4+ end here too ("Unsupported operand"): only a refused GLOBAL names code.
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        refused = next((line for line in lines if "GLOBAL" in line), None)
        if refused is None:
            detail = next((line for line in lines if line.startswith("Unsupported")), None)
            reason = f"UnpicklingError: {detail}" if detail else _reason(err)
            raise CheckpointError(
                f"refusing to load checkpoint {path}: the safe loader cannot read it (truncated or corrupt, "
                f"or more than tensors and plain data): {reason}"
            ) from None
        raise CheckpointError(
            f"refusing to load checkpoint {path}: it contains Python objects that would run code when "
            f"unpickled (only tensors and plain data are accepted): {refused}"
        ) from None
    except (*_DAMAGED, MemoryError, RecursionError) as err:  # MemoryError: sizes a damaged file claims
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({_reason(err)})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {path} is not a training checkpoint (no 'state_dict' entry)")
    return checkpoint


def _reason(err: BaseException, *, named: bool = True) -> str:
    """The first line of `err`'s message (its type's name for an empty one), for a one-line error."""
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__
    return f"{type(err).__name__}: {lines[0]}" if named else lines[0]


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
