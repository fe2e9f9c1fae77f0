"""Counting host syncs (calls that make a GPU wait) on the CPU: per decoding step of a search, or anywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from transformer.search.constraints import TargetRequest
from transformer.search.decoding import DecodingSettings, search

VOCAB = 24
# Calls that copy a device value to the host (or need its value to size a result).
_SYNC_METHODS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "cpu",
    "numpy",
}


def is_sync(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this torch call copies a device value to the host (or needs one to size its result)."""
    name = getattr(func, "__name__", "")
    if name in _SYNC_METHODS:
        return True
    if name in ("__getitem__", "__setitem__"):  # boolean-mask indexing sizes its result on the host
        index = args[1] if len(args) > 1 else None
        indices = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    if name == "repeat_interleave":  # tensor repeats: the output size is their sum
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor)
    return name == "to" and any(str(a) == "cpu" for a in args[1:])


class SyncCounter(TorchFunctionMode):
    """Counts host syncs between decoding steps (a step starts at each `decode` of the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_step = [0]  # [before the first step, step 1, step 2, ...]

    def step(self) -> None:
        self.per_step.append(0)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if is_sync(func, args, kwargs):
            self.per_step[-1] += 1
        return func(*args, **kwargs)


def syncs_per_step(
    model: Any, src: torch.Tensor, settings: DecodingSettings, requests: list[TargetRequest] | None = None
) -> list[int]:
    """Host syncs in one search of `model` (of VOCAB words): [before the first step, step 1, ...]."""
    counter = SyncCounter()
    decode_step = model.decode

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        counter.step()
        return decode_step(*args, **kwargs)

    model.decode = counted
    try:
        with counter:
            search(
                model,
                src,
                settings,
                requests=requests,
                word_continuations=range(14, VOCAB) if requests else (),
            )
    finally:
        del model.decode
    return counter.per_step
