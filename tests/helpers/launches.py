"""Kernel launches counted on the CPU (`Launches`), and the GPU's code path taken there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from transformer import kernels

# host-only calls: allocations (no kernel), autograd bookkeeping, dtype and backend choices
_NOT_LAUNCHES = {
    "empty",
    "empty_like",
    "empty_strided",
    "detach",
    "lift_fresh",
    "promote_types",
    "_fused_sdp_choice",
}
# operators that touch only the indexed elements (N of them), however large the tensor they index
_INDEXED = {"gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "index_put", "index_put_"}


class Launches(TorchDispatchMode):
    """Records the name of every launch, and for each the rows of (…, V) tensors it reads and writes."""

    active: Launches | None = None  # the one recording now (for the fused SDPA below)

    def __init__(self, vocab: int = 0, rows: int = 1) -> None:
        super().__init__()
        self.vocab = vocab  # tensors whose last dimension is this are rows of logits (0: do not track)
        self.rows = rows  # how many rows the logits have (`passes` counts per row)
        self.names: list[str] = []
        self.touches: list[tuple[str, int, int]] = []  # ("r" or "w", storage, rows)
        # every tensor touched stays alive while this recording lives: a freed temporary's address could
        # otherwise come back as another storage's (the gradient's, say) and be counted as that one
        self.alive: list[Tensor] = []
        self.paused = False  # inside a fused kernel

    def __enter__(self) -> Launches:
        Launches.active = self
        return super().__enter__()

    def __exit__(self, *args: object) -> None:
        Launches.active = None
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self.paused or func.is_view or name in _NOT_LAUNCHES:
            return out
        self.names.append(name)
        if self.vocab and name not in _INDEXED:
            in_place = name.endswith("_")
            read = [a for key, a in kwargs.items() if key != "out"] + list(args)
            written = [out, args[0]] if in_place else [out]
            for mode, tensors in (("r", read), ("w", written)):
                for t in {id(t): t for t in tree_flatten(tensors)[0] if isinstance(t, Tensor)}.values():
                    if t.dim() and t.size(-1) == self.vocab:
                        self.alive.append(t)
                        self.touches.append((mode, t.untyped_storage().data_ptr(), t.numel() // self.vocab))
        return out

    def passes(self, mode: str, storage: int | None, others: tuple[int, ...] = ()) -> float:
        """Rows read ("r") or written ("w") in `storage`, or (None) in any storage but `others`, per row."""
        rows = sum(
            r for m, s, r in self.touches if m == mode and (s == storage if storage else s not in others)
        )
        return rows / self.rows


def take_the_cuda_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA code: attention kernels that are not the CPU's and for which torch picks its memory-efficient
    backend (which zeroes fully masked rows itself); the fused SDPA counted as one launch."""
    monkeypatch.setattr(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset())
    monkeypatch.setattr(kernels, "_sdpa_backend", lambda *args: SDPBackend.EFFICIENT_ATTENTION, raising=False)
    monkeypatch.setattr(kernels, "_WITHOUT_CUDNN_DEVICES", frozenset({"cpu"}), raising=False)
    original: Callable[..., Tensor] = F.scaled_dot_product_attention

    def fused(*args: Any, **kwargs: Any) -> Tensor:
        launches = Launches.active
        if launches is None:
            return original(*args, **kwargs)
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:
            launches.names.append("where")  # SDPA turns a boolean mask into an additive one first
        launches.names.append("scaled_dot_product_attention")
        launches.paused = True
        try:
            return original(*args, **kwargs)
        finally:
            launches.paused = False

    monkeypatch.setattr(F, "scaled_dot_product_attention", fused)
