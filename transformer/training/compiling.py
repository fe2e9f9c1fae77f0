"""`model.compile=true`: a task's training forward and loss through `torch.compile`, as one graph;
`model.compile=layers`: only the encoder and decoder layers, each stack's copies sharing one compiled layer
(`transformer.stacks.compile_layers`, regional compilation), which compiles in a fraction of the time.

What compiles is the padded (B, L) layout: the packed path's shapes depend on the data (`Seq2SeqTransformer`
never packs under tracing) and the CPU dropout's 16-bit masks use an op Dynamo cannot trace
(`transformer.dropout` runs torch's dropout there, which the compiler fuses). Every dimension of the
step's input tensors is marked dynamic, so bucketed batches of any shape share one graph: the first
call compiles it (with shapes as symbols), and only a shape that breaks a guard (a batch of one row,
which Dynamo specializes) compiles again. Python scalars (the learning rate, the step) never enter the
graph: the optimizer and the schedule run outside it. Each compilation is timed and logged;
`TORCH_LOGS=graph_breaks,recompiles` shows Dynamo's own account.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch import Tensor

from transformer.inductor import compile_options

__all__ = [
    "LENGTH_MULTIPLE",
    "CompiledStep",
    "check_compile_mode",
    "compile_unavailable",
    "fused_loss_conflict",
    "is_compile_mode",
    "pad_length",
]

log = logging.getLogger(__name__)


# The compiled step's inputs are padded to lengths that are multiples of this. CUDA's memory-efficient
# attention needs its mask's rows aligned (a multiple of 8 elements); in eager mode torch pads the mask
# itself, but in a compiled graph that choice is fixed when it is traced, so a batch whose lengths have
# another alignment compiles the graph again (pytorch#163083). With every length a multiple of 8 there is
# one alignment; the matmuls' token dimensions suit the tensor cores too. Suspected, not yet confirmed, as
# the cause of the 2 recompilations bench_gpu.py saw on an H200 (benchmarks/README.md).
LENGTH_MULTIPLE = 8


def pad_length(ids: Tensor, pad_id: int, multiple: int = LENGTH_MULTIPLE) -> Tensor:
    """(B, L) token ids -> (B, L') with pads appended, L' the next multiple of `multiple` (the same tensor
    when L already is one). Trailing pads change no loss: a source's are masked keys, a target's come after
    every real position (causal attention) and the loss ignores them."""
    extra = -ids.size(-1) % multiple
    return torch.nn.functional.pad(ids, (0, extra), value=pad_id) if extra else ids


def is_compile_mode(value: object) -> bool:
    """Whether `value` is a `model.compile` setting: false, true (the training step as one graph) or
    "layers" (the layers, one graph per stack); 1 and 0 are not booleans here."""
    return isinstance(value, bool) or value == "layers"


def check_compile_mode(value: object) -> None:
    """Raise ValueError unless `value` is a `model.compile` setting."""
    if not is_compile_mode(value):
        raise ValueError(f"compile must be true, false or 'layers', got {value!r}")


def fused_loss_conflict(compile: object) -> str | None:
    """Why `model.fused_loss=true` is refused with the `model.compile` setting `compile`, None when it is
    not (compile false). The fused loss is a custom autograd Function looping over row chunks in Python:
    not what to trace, and the compiled step fuses the projection and the loss itself."""
    if not compile:
        return None
    if compile == "layers":
        why = "the fused loss is tested on the eager step only, not around compiled layers"
    else:
        why = "the compiled step fuses the output projection and the loss itself"
    return (
        f"model.fused_loss=true does not go with model.compile={str(compile).lower()}: {why} "
        "(set model.fused_loss=false or model.compile=false)"
    )


def _graphs_compiled() -> int:
    """How many graphs Dynamo has compiled in this process (any function, any backend)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class CompiledStep:
    """`fn(*tensors)` through `torch.compile(fn, backend=..., fullgraph=...)`, each input's dimensions
    marked dynamic; with `whole=False`, `fn` as it is, whose layers are compiled (`compile_layers`). A call
    that compiled a graph starts a clock that `finished()` (at the end of the training step: the backward
    graph compiles in the backward pass) stops and logs."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        *,
        backend: str = "inductor",
        fullgraph: bool = False,
        whole: bool = True,
    ) -> None:
        self.name = name
        self.backend = backend
        options = compile_options(backend)
        self._compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph, **options) if whole else fn
        self.compilations = 0  # calls that compiled a graph
        self.seconds = 0.0  # their wall time, forward to end of step (compiling plus one run)
        self._started: float | None = None
        self._shapes = ""

    def __call__(self, *tensors: Tensor) -> Any:
        for tensor in tensors:
            for dim in range(tensor.dim()):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        before, start = _graphs_compiled(), time.perf_counter()
        out = self._compiled(*tensors)
        if _graphs_compiled() > before:
            self._started = start
            self._shapes = ", ".join("x".join(map(str, t.shape)) for t in tensors)
        return out

    def finished(self) -> None:
        """The step that called it has ended: log the compilation it triggered, if it did."""
        if self._started is None:
            return
        seconds = time.perf_counter() - self._started
        self._started = None
        self.compilations += 1
        self.seconds += seconds
        log.info(
            "torch.compile (%s): compiled %s in %.1f s (compilation %d, %.1f s in all; inputs %s)",
            self.backend,
            self.name,
            seconds,
            self.compilations,
            self.seconds,
            self._shapes,
        )

    def __deepcopy__(self, memo: dict) -> None:
        """A copy of the task (e.g. the averaged weights of EMA) runs eagerly: None in its place."""
        return None


def compile_unavailable(device_type: str) -> str | None:
    """Why `torch.compile` (with its default backend, inductor) cannot run on `device_type` here, or None."""
    if not torch._dynamo.is_dynamo_supported():
        return f"torch {torch.__version__} cannot compile on Python {sys.version.split()[0]}"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor needs Triton on CUDA, which is not installed (pip install triton)"
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as err:  # no C++ compiler on PATH (inductor's CPU code is C++)
        return f"inductor needs a C++ compiler on the CPU ({type(err).__name__}: {err})"
    return None
