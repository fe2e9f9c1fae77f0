"""The GPU's code path on a CPU-only torch, for counting what a CUDA training step runs
(`benchmarks.gpu.bytes_per_step`): the CUDA branches of the project's kernels, losses and dropout
(`cuda_code_path`), and CUDA autocast's float32 policy registered for the CPU's autocast key
(`cuda_autocast_policy`, CPU autocast leaves LayerNorm and softmax in bf16, CUDA runs them in float32)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from transformer import dropout, kernels, losses

__all__ = ["cuda_autocast_policy", "cuda_code_path"]

# CUDA autocast's float32 operations that the model and loss use and CPU autocast leaves in low precision
# (torch/csrc/autocast_mode.cpp: KERNEL_CUDA(..., fp32) and fp32_set_opt_dtype)
_CUDA_FP32 = ("layer_norm", "softmax.int", "log_softmax.int", "exp", "log", "pow.Tensor_Scalar", "rsqrt")


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """CPU autocast with CUDA's float32 list for the operations in _CUDA_FP32 (inputs cast to float32,
    as CUDA autocast does), while the context is open."""
    library = torch.library.Library("aten", "IMPL")
    for qualified in _CUDA_FP32:
        name, _, overload = qualified.partition(".")
        op = getattr(getattr(torch.ops.aten, name), overload or "default")
        library.impl(qualified, _in_float32(op), "AutocastCPU")
    try:
        yield
    finally:
        library._destroy()


def _in_float32(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        lowp = (torch.bfloat16, torch.float16)
        args = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype in lowp else a for a in args)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return op(*args, **kwargs)

    return kernel


class _CudaDropout:
    """`torch.nn.functional` as transformer/dropout.py sees it on CUDA: `dropout` is one `native_dropout`
    kernel (the input read, the output and a boolean mask written; its backward reads the mask), where
    the CPU's `F.dropout` draws, scales and multiplies in three."""

    @staticmethod
    def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
        return torch.native_dropout(x, p, training)[0]


@contextlib.contextmanager
def cuda_code_path() -> Iterator[None]:
    """The CUDA branches of kernels.py, losses.py and dropout.py, taken on the CPU (packed attention in
    torch's variable-length kernel, as on an sm80+ GPU)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(kernels, "_VARLEN_DEVICES", frozenset({"cuda", "cpu"})))
        stack.enter_context(mock.patch.object(dropout, "_OWN_MASK_DEVICES", frozenset()))
        stack.enter_context(mock.patch.object(dropout, "F", _CudaDropout))
        stack.enter_context(mock.patch.object(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset({"cpu"})))
        stack.enter_context(mock.patch.object(kernels, "_WITHOUT_CUDNN_DEVICES", frozenset({"cpu"})))
        chunk = losses._CHUNK_ELEMENTS_BY_DEVICE["cuda"]
        stack.enter_context(mock.patch.object(losses, "_CHUNK_ELEMENTS", chunk))
        stack.enter_context(mock.patch.object(losses, "_ONE_KERNEL_GRAD_WRITE", frozenset({"cpu"})))
        yield
