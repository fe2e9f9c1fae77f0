"""The compiled decoding step of `decode.kv_cache=compiled`: `next_log_probs` through `torch.compile`,
one graph per kind of search (greedy, beam) whatever the bucket (`transformer.search.buckets`), and
never a silent fallback: should Dynamo give up (its recompile limit, a compile error), one warning
names what happened and the setting, and the process decodes on with the step run eagerly.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import torch
from torch import Tensor

from transformer.search.step import next_log_probs

__all__ = ["RECOMPILE_LIMIT", "CompiledStep", "compile_step"]

log = logging.getLogger(__name__)

# Compilations of the step one process may make: 2 with buckets (greedy, beam), more for other models
# or step rules (min_len, temperature) in the same process; beyond, the step runs eagerly (warned).
RECOMPILE_LIMIT = 8
# what Dynamo raises when it gives up on a frame (fullgraph: instead of running it eagerly, silently);
# looked up by name: the project allows torch >= 2.4, whose exceptions are named otherwise
_GAVE_UP = tuple(
    getattr(torch._dynamo.exc, name)
    for name in ("TorchDynamoException", "FailOnRecompileLimitHit", "FailOnCacheLimitHit")
    if hasattr(torch._dynamo.exc, name)
)


class CompiledStep:
    """`next_log_probs` compiled (fullgraph: a graph break is an error, not a slow step), with the eager
    step as the logged fallback. `cuda_graphs`: mode "reduce-overhead", each step a CUDA graph replay
    (`cudagraph_mark_step_begin`: the last step's outputs are consumed, their memory reused)."""

    def __init__(self, compiled: Callable[..., Tensor], cuda_graphs: bool = False) -> None:
        self.compiled = compiled
        self.cuda_graphs = cuda_graphs
        self.failure: str | None = None  # why the step runs eagerly, once it does

    def __call__(self, *args: object) -> Tensor:
        if self.failure is None:
            try:
                if self.cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                return self.compiled(*args)
            except _GAVE_UP as error:
                # raised while tracing or compiling, before the step ran: nothing was written yet
                self._give_up(error)
        return next_log_probs(*args)

    def _give_up(self, error: BaseException) -> None:
        lines = str(error).strip().splitlines()
        self.failure = f"{type(error).__name__}: {lines[0] if lines else ''}"
        log.warning(
            "decode.kv_cache=compiled: torch.compile gave up on the decoding step (%s); this process "
            "decodes on with the step run eagerly, as decode.kv_cache=static (recompile limit %d; "
            "TORCH_LOGS=recompiles shows why it recompiled)",
            self.failure,
            RECOMPILE_LIMIT,
        )


def compile_step(device: torch.device, backend: str | Callable[..., object] = "inductor") -> CompiledStep:
    """The process's compiled step for `device`: on CUDA in mode "reduce-overhead" (a CUDA graph per
    bucket, replayed over the bucket's fixed-address `StaticBuffers`), elsewhere inductor's default
    code generation; `backend` "aot_eager" or "eager" for cheap tests; "cudagraphs" on CUDA: the step's
    eager kernels recorded as CUDA graphs, with no code generation (bench_gpu.py measures it as `ours
    cudagraphs step`: less to compile, no fusion). One per process, kind of device and backend, so that
    Dynamo's cache (and the warning) is the process's."""
    return _compile_step(device.type == "cuda" and backend in ("inductor", "cudagraphs"), backend)


@functools.cache
def _compile_step(cuda_graphs: bool, backend: str | Callable[..., object]) -> CompiledStep:
    # a limit of this function's own where torch.compile takes one (older: Dynamo's default, also 8)
    limit = {"recompile_limit": RECOMPILE_LIMIT}
    options = limit if "recompile_limit" in inspect.signature(torch.compile).parameters else {}
    mode = "reduce-overhead" if cuda_graphs and backend == "inductor" else None  # cudagraphs: graphs itself
    compiled = torch.compile(next_log_probs, backend=backend, mode=mode, fullgraph=True, **options)
    return CompiledStep(compiled, cuda_graphs)
