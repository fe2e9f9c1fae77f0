"""Inductor's settings for our compiled training graphs (the step, `training/compiling.py`; the layers,
`stacks.compile_layers`): `compile_options`, the keyword arguments both pass to `torch.compile`."""

from __future__ import annotations

from typing import Any

__all__ = ["compile_options"]

# Inductor fuses a reduction over rows with one over columns (layer norm's backward: the input's gradient
# and the weight's) when the tensor is large, deciding from its size at compile time and guarding on the
# choice: a later batch on the other side of 5 * 2**20 elements compiles again. On an H200 (torch 2.11)
# that cost the whole compiled step and the compiled layers one recompilation each among bench_gpu.py's
# timed steps (benchmarks/results/gpu/2026-11-27_h200_bench_gpu_run2.log). The non-strict mode skips the size
# checks, so there is no guard; the fusion is chosen the same way for every batch.
_INDUCTOR_OPTIONS = {"triton.mix_order_reduction_non_strict_mode": True}


def compile_options(backend: object) -> dict[str, Any]:
    """Keyword arguments for `torch.compile` of our training graphs (the step, the layers): Inductor's
    settings that keep bucketed batches on one graph (`_INDUCTOR_OPTIONS`, those the installed torch
    has); none for another backend, which takes no options."""
    if backend != "inductor":
        return {}
    from torch._inductor import config

    def known(key: str) -> bool:  # "triton.x": config.triton.x
        owner: object = config
        *path, name = key.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        return hasattr(owner, name)

    options = {key: value for key, value in _INDUCTOR_OPTIONS.items() if known(key)}
    return {"options": options} if options else {}
