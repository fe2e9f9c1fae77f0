"""The residual stream's precision under autocast: `LayerNorm`, which can run in the autocast dtype with
float32 statistics, and `residual_in_autocast_dtype`, the switch a training task turns on for a model.

Under CUDA autocast (bf16-mixed) LayerNorm is on the float32 list: it returns float32, so every residual
add, dropout and the next LayerNorm's input are float32, and each matrix multiply casts its input back to
bf16. With the switch on, the embedding output is cast once to the autocast dtype and each LayerNorm runs
outside autocast on its low-precision input: the kernels (CPU and CUDA) accumulate the mean and variance in
float32 and write the output in the input's dtype, as the low-precision LayerNorms of large-model trainers
do. The residual adds and dropout then run in bf16: half the bytes of the residual stream
(benchmarks/gpu/bytes_per_step.py). Without autocast, or with the switch off, nothing changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LOW_PRECISION", "LayerNorm", "autocast_dtype", "residual_in_autocast_dtype"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The low-precision dtype autocast computes in on `x`'s device, or None outside autocast."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype in LOW_PRECISION else None


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (the same parameters and state dict); with `in_autocast_dtype` set and a
    low-precision input under autocast, normalised in that dtype with float32 statistics."""

    in_autocast_dtype: bool = False

    def forward(self, x: Tensor) -> Tensor:
        if not self.in_autocast_dtype or x.dtype not in LOW_PRECISION or autocast_dtype(x) is None:
            return super().forward(x)
        weight = None if self.weight is None else self.weight.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def residual_in_autocast_dtype(model: nn.Module, enabled: bool = True) -> int:
    """Switch every `LayerNorm` of `model` and every module with an `in_autocast_dtype` flag (the
    embedders) to the autocast dtype (or back); returns how many modules it switched."""
    switched = [module for module in model.modules() if hasattr(module, "in_autocast_dtype")]
    for module in switched:
        module.in_autocast_dtype = enabled
    return len(switched)
