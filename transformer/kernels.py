"""Scaled dot-product attention (Vaswani et al., 2017, §3.2.1) and its masks, below `MultiHeadAttention`.

Owns the mask conventions (`make_causal_mask`, the shape checks, the one helper that turns the torch-style
masks into what the kernel takes) and `attend`, which picks `F.scaled_dot_product_attention` or the
softmax written out (when the weights are returned) and gives fully masked query rows zeros, not NaN; and
`use_varlen` / `varlen_attend`, attention over packed tokens with torch's variable-length kernel.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "RotaryLike",
    "VarlenLengths",
    "additive_mask",
    "attend",
    "attention_backends",
    "attention_dtype",
    "check_masks",
    "make_causal_mask",
    "merge_masks",
    "use_varlen",
    "varlen_attend",
]

log = logging.getLogger(__name__)

# rotary(x: (B, H, L, Dh), offset: int) -> (B, H, L, Dh); offset = positions already in the cache.
RotaryLike = Callable[[Tensor, int], Tensor]

# Devices all of whose `F.scaled_dot_product_attention` backends (math and flash on the CPU) return 0, with
# finite gradients, for a query row whose keys are all masked: no fix-up and no question asked there.
# tests/unit/test_attention_behaviour.py checks the claim on the installed torch.
_SDPA_ZEROES_EMPTY_ROWS = frozenset({"cpu"})
# Backends that do so on every device since torch 2.5 (pytorch#131863, "_safe_softmax"): math (checked on
# the CPU), flash (the CPU's kernel takes masks and is checked; CUDA's takes none, so it never sees an empty
# row) and CUDA's memory-efficient kernel (it set such rows to NaN in 2.1-2.4, pytorch#110213). cuDNN's and
# other devices' kernels are not known to (pytorch#196678: cuDNN's backward gives NaN for very small
# row log-sum-exps); there the rows are fixed up by hand. A CUDA test (-m gpu) checks each backend.
_ZEROING_BACKENDS = frozenset({SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION})
# Devices whose SDPA runs without cuDNN's backend. cuDNN builds an execution plan for every new input
# shape: 0.2-0.3 s each on an H200 (torch 2.11), and length-bucketed batches make nearly every training
# step and every decoding batch a new shape (a WMT-base bf16 training step over varying batches: 0.31 s
# with cuDNN first, as torch 2.11 orders the backends on Hopper, 0.076 s without; on one batch repeated
# 0.088 and 0.082 s; benchmarks/results/gpu/2026-11-27_h200_gpu_profile.txt). What is left (flash, then
# memory-efficient, then math) zeroes fully masked rows itself, so no row needs fixing up there either.
_WITHOUT_CUDNN_DEVICES = frozenset({"cuda"})
_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_TORCH_ZEROES_EMPTY_ROWS = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)  # see above


def make_causal_mask(
    size: int, device: torch.device | str | None = None, *, num_keys: int | None = None
) -> Tensor:
    """Boolean (T, S) mask, True = masked out: query i may attend to keys 0 .. S - T + i.

    `size` is T; `num_keys` (S, default T) > T aligns the queries with the *last* T keys, which is
    where new positions sit when earlier keys come from a KV cache.
    """
    num_keys = size if num_keys is None else num_keys
    return torch.ones(size, num_keys, dtype=torch.bool, device=device).triu_(num_keys - size + 1)  # (T, S)


def check_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
) -> None:
    """Raise ValueError naming the expected and received shape of a mask that does not fit."""
    for name, mask in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
            raise ValueError(f"{name} must be bool or floating point, got dtype {mask.dtype}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, k_len):
        raise ValueError(
            f"key_padding_mask must have shape (N, S) = {(batch, k_len)}, got {tuple(key_padding_mask.shape)}"
        )
    if attn_mask is not None:
        expected = [(q_len, k_len), (batch * heads, q_len, k_len)]
        if tuple(attn_mask.shape) not in expected:
            raise ValueError(
                f"attn_mask must have shape (L, S) = {expected[0]} or (N*num_heads, L, S) = "
                f"{expected[1]}, got {tuple(attn_mask.shape)}"
            )


def merge_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    batch: int,
    heads: int,
    n_extra: int,
    dtype: torch.dtype,
) -> Tensor | None:
    """Fold the torch-style masks into the one form `F.scaled_dot_product_attention` takes.

    Inputs use the `nn.MultiheadAttention` meaning (bool True = do not attend, float = added to the
    scores) and are already shape-checked: attn_mask (T, S) or (B*H, T, S), key_padding_mask (B, S).
    Returns None, a bool mask with SDPA's polarity (True = attend), or an additive float mask in `dtype`,
    broadcastable to (B, H, T, S + n_extra); the `n_extra` trailing columns (bias_k, zero attention)
    are always attended to. Nothing is expanded beyond what broadcasting needs: a padding mask alone
    stays (B, 1, 1, S).
    """
    masks = []
    if attn_mask is not None:
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.view(batch, heads, *attn_mask.shape[1:])  # (B*H, T, S) -> (B, H, T, S)
        masks.append(attn_mask)
    if key_padding_mask is not None:
        masks.append(key_padding_mask[:, None, None, :])  # (B, S) -> (B, 1, 1, S)
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        merged = masks[0] if len(masks) == 1 else masks[0] | masks[1]
        merged = ~merged  # SDPA's boolean polarity is the opposite of nn.MultiheadAttention's
        return F.pad(merged, (0, n_extra), value=True) if n_extra else merged
    # A float mask anywhere: bools become additive -inf (exactly zero weight after the softmax).
    additive = [additive_mask(m, dtype) if m.dtype == torch.bool else m.to(dtype) for m in masks]
    merged = additive[0] if len(additive) == 1 else additive[0] + additive[1]
    return F.pad(merged, (0, n_extra), value=0.0) if n_extra else merged


def additive_mask(masked: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask (True = masked out) as the additive one it stands for: 0 where attended, -inf where
    masked, in `dtype`. The form every SDPA kernel but cuDNN's computes with: torch converts a boolean
    mask into it inside each call (a kernel per call), so a mask used by many calls, such as the source
    padding of every decoding step, is cheaper converted once. Either form gives the same output."""
    return torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(masked, -math.inf)


def attention_dtype(x: Tensor) -> torch.dtype:
    """The dtype attention computes in for activations like `x`: autocast's on `x`'s device when it is
    on (the projections' outputs take it), else `x`'s own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def attention_backends(device: torch.device | str) -> AbstractContextManager[object]:
    """The SDPA backends our attention runs with on `device`: on CUDA all but cuDNN's (see
    `_WITHOUT_CUDNN_DEVICES`), elsewhere torch's own choice. Each attention call enters it unless it is
    already on (a check of a flag), so a loop of many small calls, such as a search, enters it once
    around the loop and saves the context's cost (~10-20 µs) per call."""
    return (
        sdpa_kernel(_WITHOUT_CUDNN) if torch.device(device).type in _WITHOUT_CUDNN_DEVICES else nullcontext()
    )


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    *,
    is_causal: bool,
    need_weights: bool,
    n_extra: int = 0,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor | None]:
    """softmax(QK^T / sqrt(Dh) + mask) V: q (B, H, T, Dh), k and v (B, H, S + n_extra, Dh) -> (B, H, T, Dh),
    and the weights (B, H, T, S + n_extra) when `need_weights`, else None.

    Masks as checked by `check_masks`; the `n_extra` trailing key columns (bias_k, zero attention) are
    never masked. `is_causal` without attn_mask masks later keys (aligned with the last T keys).
    """
    batch, heads, q_len, _ = q.shape
    k_len = k.shape[2] - n_extra
    # SDPA's own causal kernel when that is exactly the mask, otherwise one merged mask
    sdpa_causal = False
    if is_causal and key_padding_mask is None and n_extra == 0 and q_len == k_len and not need_weights:
        sdpa_causal, attn_mask = True, None  # like the torch module, trust the is_causal hint
    elif is_causal and attn_mask is None and q_len > 1:
        attn_mask = make_causal_mask(q_len, q.device, num_keys=k_len)  # (T, S)
    mask = merge_masks(attn_mask, key_padding_mask, batch, heads, n_extra, q.dtype)
    if not need_weights:  # the fused kernel
        return _sdpa(q, k, v, mask, dropout_p, sdpa_causal, fix_empty_rows=n_extra == 0), None
    return _attend_explicit(q, k, v, mask, dropout_p, n_extra)


def _sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    fix_empty_rows: bool,
) -> Tensor:
    """F.scaled_dot_product_attention -> (B, H, T, Dh); query rows with every key masked give zeros.

    Runs without cuDNN's kernel on `_WITHOUT_CUDNN_DEVICES`. Most kernels zero empty rows themselves
    (`_ZEROING_BACKENDS`): then nothing is added. Otherwise an empty row attends to every key (finite) and
    its output is zeroed: 3 kernels for a boolean mask (4 for a float one), the last one over the output.
    """
    # sdpa_kernel and nullcontext are both traced by torch.compile, no graph break; outside a compiled
    # graph the context is skipped when a caller (a search) already entered `attention_backends`
    backends = (
        sdpa_kernel(_WITHOUT_CUDNN)
        if q.device.type in _WITHOUT_CUDNN_DEVICES
        and (torch.compiler.is_compiling() or torch.backends.cuda.cudnn_sdp_enabled())
        else nullcontext()
    )
    with backends:  # the chooser below and the kernel see the same backends
        fix = (
            fix_empty_rows
            and mask is not None
            and _kernel_leaves_empty_rows(q, k, v, mask, dropout_p, is_causal)
        )
        if not fix or mask is None:
            return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal)  # (B, H, T, Dh)
        if mask.dtype == torch.bool:
            has_key = mask.any(dim=-1, keepdim=True)  # (…, T, 1)
            mask = mask >= has_key  # mask | ~has_key in one kernel: an empty row attends to every key
            return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal) * has_key
        empty = mask.amax(dim=-1, keepdim=True) == -math.inf  # (…, T, 1)
        out = F.scaled_dot_product_attention(q, k, v, mask.masked_fill(empty, 0.0), dropout_p, is_causal)
        return out.masked_fill(empty, 0.0)  # (B, H, T, Dh)


def _kernel_leaves_empty_rows(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout_p: float, is_causal: bool
) -> bool:
    """Whether the SDPA kernel these inputs go to may leave a fully masked query row non-zero (NaN)."""
    if q.device.type in _SDPA_ZEROES_EMPTY_ROWS:
        return False
    if q.device.type in _WITHOUT_CUDNN_DEVICES and _TORCH_ZEROES_EMPTY_ROWS:  # only zeroing backends left
        return False
    if torch.compiler.is_compiling():  # torch's chooser cannot be traced; the compiler fuses the fix-up
        return True
    device = q.device.type
    if torch.is_autocast_enabled(device) and q.dtype != torch.get_autocast_dtype(device):
        return True  # autocast casts SDPA's inputs (not the chooser's): it may pick another kernel
    return _sdpa_backend(q, k, v, mask, dropout_p, is_causal) not in _ZEROING_BACKENDS


def _sdpa_backend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, is_causal: bool
) -> SDPBackend:
    """The backend `F.scaled_dot_product_attention` runs for these arguments: torch's own choice (the
    function SDPA itself calls; host-side checks of shapes, dtypes and the device, no kernel)."""
    return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal))


def _empty_rows(mask: Tensor) -> Tensor:
    """Query rows (…, T, 1) whose keys are all masked in a mask from `merge_masks`."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def _attend_explicit(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, n_extra: int
) -> tuple[Tensor, Tensor]:
    """softmax(QK^T / sqrt(Dh) + mask) V written out, for when the weights are returned."""
    # scaling q (T x Dh) is cheaper than scaling the scores (T x S) and makes the copy matmul needs anyway
    scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-2, -1))  # (B, H, T, S)
    empty = None
    if mask is not None:
        if n_extra == 0:
            empty = _empty_rows(mask)  # (…, T, 1)
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
        if empty is not None:  # a finite row keeps softmax and its gradient NaN-free; zeroed below
            scores = scores.masked_fill(empty, 0.0)
    weights = torch.softmax(scores, dim=-1)
    if empty is not None:
        weights = weights.masked_fill(empty, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.matmul(weights, v), weights  # (B, H, T, Dh), (B, H, T, S)


# Variable-length attention: torch.nn.attention.varlen.varlen_attn (torch >= 2.10) runs Flash Attention over
# packed (N, H, Dh) tokens with cumulative sequence lengths, so no pad token is attended or stored. Per its
# source (torch 2.13) it calls aten._flash_attention_forward / _backward: CUDA only (NVIDIA sm80+ per its
# tutorial), float16 / bfloat16, attention dropout fixed at 0. Causality was `is_causal=True` in torch 2.10
# and is `window_size=(-1, 0)` since pytorch#172245 (January 2026); the call below takes whichever the
# installed signature has. Everywhere else packed attention unpacks to the padded layout (`attend`).
try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch < 2.10
    _varlen_attn = None
_VARLEN_DEVICES = frozenset({"cuda"})
_VARLEN_DTYPES = frozenset({torch.float16, torch.bfloat16})
_VARLEN_MAX_HEAD_DIM = 256  # Flash Attention's limit

VarlenLengths = tuple[Tensor, int]  # (cu_seqlens (B + 1,) int32 on the device, the longest row)


def use_varlen(
    x: Tensor,
    head_dim: int,
    dropout_p: float,
    rotary: bool,
    query_lengths: VarlenLengths | tuple[None, None],
    key_lengths: VarlenLengths | tuple[None, None],
) -> bool:
    """Whether attention over packed tokens x (N, ...) runs as `varlen_attend` (the one place this is
    chosen): the installed torch has the kernel for x's device and dtype, the head dim fits it, there is no
    attention dropout (the kernel has none) nor rotary positions (applied in the padded layout), and both
    sides' cumulative lengths were built on the host (`TokenPacking.from_index`). Logged once per case."""
    lengths_known = query_lengths[0] is not None and key_lengths[0] is not None
    kernel = _varlen_attn is not None and _device_has_varlen(x.device) and x.dtype in _VARLEN_DTYPES
    chosen = kernel and lengths_known and dropout_p == 0.0 and not rotary and head_dim % 8 == 0
    chosen = chosen and head_dim <= _VARLEN_MAX_HEAD_DIM
    _log_packed_attention(x.device.type, x.dtype, chosen, kernel, lengths_known)
    return chosen


def _device_has_varlen(device: torch.device) -> bool:
    """A device varlen_attn runs on: CUDA with Flash Attention built in and compute capability >= 8.0
    (asked of the driver once per device, not read from the device's memory)."""
    if device.type not in _VARLEN_DEVICES:
        return False
    return device.type != "cuda" or _cuda_has_flash(device.index)


@functools.cache
def _cuda_has_flash(index: int | None) -> bool:
    flash = torch.backends.cuda.is_flash_attention_available()
    return flash and torch.cuda.get_device_capability(index) >= (8, 0)


@functools.cache
def _log_packed_attention(
    device: str, dtype: torch.dtype, chosen: bool, kernel: bool, lengths_known: bool
) -> None:
    if chosen:
        log.info("packed attention on %s (%s): torch's variable-length kernel (varlen_attn)", device, dtype)
        return
    why = (
        "no cumulative lengths from the host" if kernel and not lengths_known
        else "attention dropout, rotary positions or the head dim" if kernel
        else f"torch {torch.__version__} has no varlen_attn for it"
    )  # fmt: skip
    log.info("packed attention on %s (%s): the padded layout with masks (%s)", device, dtype, why)


def varlen_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    query_lengths: VarlenLengths,
    key_lengths: VarlenLengths,
    *,
    is_causal: bool,
) -> Tensor:
    """softmax(QK^T / sqrt(Dh)) V within each sequence: q (N, H, Dh), k and v (M, H, Dh) packed, row b's
    queries q[cu_q[b]:cu_q[b+1]] attending to keys k[cu_k[b]:cu_k[b+1]] (`is_causal`: key j <= query i,
    for self-attention over prefixes) -> (N, H, Dh). Only `use_varlen` decides that this runs."""
    assert _varlen_attn is not None, "use_varlen checks it"
    (cu_q, max_q), (cu_k, max_k) = query_lengths, key_lengths
    if _takes_window_size(_varlen_attn):
        return _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0) if is_causal else (-1, -1))
    return _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal)  # torch 2.10


@functools.cache
def _takes_window_size(kernel: Callable[..., Tensor]) -> bool:
    return "window_size" in inspect.signature(kernel).parameters
