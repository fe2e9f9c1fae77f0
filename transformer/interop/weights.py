"""A `save_pretrained` directory's weights checked against its config.json before anything is allocated.

`check_weights` reads the tensor names and shapes from the weight files' headers alone (safetensors; a
`pytorch_model.bin` onto the meta device), builds the transformers model the config describes on the meta
device (no memory), and refuses, with an `ExportError` naming the file and the tensor: a damaged weight
file (truncated, corrupt header), a config whose sizes disagree with the weights (every tensor both have
must have one shape), weights the config's model needs but the file lacks (transformers would fill them
with random numbers), and tensors the model computes itself (Marian's sinusoid tables) larger than the
weights themselves (a `max_position_embeddings` of 1e12). Only then is `from_pretrained` called.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from transformer.disk import human_size
from transformer.interop.source import ExportError

__all__ = ["MAX_CLASSES", "check_weights", "weight_shapes"]

# A new classification head's size bound: more classes than this is not a sentence classifier's label set
# (and a typo such as --num-classes 1000000000000 would allocate terabytes)
MAX_CLASSES = 100_000

_SAFETENSORS, _BIN = "model.safetensors", "pytorch_model.bin"


def weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in `directory`'s weights (safetensors, sharded or not, else
    pytorch_model.bin), from the headers: no tensor data is read."""
    files = _weight_files(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            shapes.update(_safetensors_shapes(path) if path.suffix == ".safetensors" else _bin_shapes(path))
        except Exception as err:  # safetensors' own SafetensorError, torch.load's zoo: all mean "damaged"
            lines = str(err).strip().splitlines()
            reason = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
            raise ExportError(
                f"cannot import {directory}: its weights file {path.name} is truncated or corrupt ({reason})"
            ) from None
    return shapes


def _weight_files(directory: Path) -> list[Path]:
    for single, index in (
        (_SAFETENSORS, "model.safetensors.index.json"),
        (_BIN, "pytorch_model.bin.index.json"),
    ):
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():
            try:
                weight_map = json.loads((directory / index).read_text(encoding="utf-8"))["weight_map"]
                names = sorted({str(name) for name in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise ExportError(f"cannot import {directory}: {index} cannot be read ({err})") from None
            missing = [name for name in names if not (directory / name).is_file()]
            if missing:
                raise ExportError(f"cannot import {directory}: {index} names {missing[0]}, which is missing")
            return [directory / name for name in names]
    raise ExportError(f"cannot import {directory}: it has no weights ({_SAFETENSORS} or {_BIN})")


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:  # validates the header against the file's size
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118


def _bin_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    state = torch.load(path, map_location="meta", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError("not a state dict")
    return {str(name): tuple(value.shape) for name, value in state.items() if isinstance(value, torch.Tensor)}


def check_weights(
    directory: Path,
    cls: Any,
    config: Any,
    *,
    computed: Collection[str] = (),
    lacking_ok: Collection[str] = (),
) -> None:
    """Refuse `directory` (see the module docstring) unless its weights fit the transformers model `cls`
    built from `config`. `computed`: tensors the model rebuilds itself (never in the file, bounded by the
    weights' size); `lacking_ok`: name prefixes that may be missing from the file (a new head); None of
    either: every other tensor of the model must be in the file (or tied to one that is)."""
    shapes = weight_shapes(directory)
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as err:  # transformers' own checks (heads not dividing the width), bad value types
        lines = str(err).strip().splitlines()
        reason = lines[0] if lines else type(err).__name__
        raise ExportError(
            f"cannot import {directory}: its config.json describes no valid model ({reason})"
        ) from None
    prefix = f"{model.base_model_prefix}."
    expected = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    found: set[str] = set()
    for name, shape in shapes.items():
        ours = next((n for n in (name, prefix + name, name.removeprefix(prefix)) if n in expected), None)
        if ours is None:
            continue  # a tensor transformers ignores too (e.g. a pooler the classifier has none of)
        found.add(ours)
        if shape != expected[ours]:
            raise ExportError(
                f"cannot import {directory}: its config.json disagrees with its weights: {name} has shape "
                f"{list(shape)} in the weights, {list(expected[ours])} by config.json"
            )
    tied = _tied_groups(model)
    lacking = [
        name
        for name in expected
        if name not in found
        and name not in computed
        and not name.startswith(tuple(lacking_ok))
        and not (tied.get(name, set()) & found)
    ]
    if lacking:
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        raise ExportError(
            f"cannot import {directory}: its weights lack {', '.join(lacking[:3])}{more}, which the model of "
            "its config.json has"
        )
    weights = sum(math.prod(shape) for shape in shapes.values())
    extra = sum(math.prod(expected[name]) for name in computed if name in expected)
    if extra > weights:
        tables = ", ".join(f"{name} {list(expected[name])}" for name in computed if name in expected)
        raise ExportError(
            f"cannot import {directory}: its config.json asks for tables of {human_size(4 * extra)} "
            f"({tables}), more than all its weights ({human_size(4 * weights)}): check "
            "max_position_embeddings"
        )


def _tied_groups(model: torch.nn.Module) -> dict[str, set[str]]:
    """name -> the names of every tensor that is the same parameter (tied embeddings)."""
    by_tensor: dict[int, set[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(parameter), set()).add(name)
    return {name: group for group in by_tensor.values() for name in group}
