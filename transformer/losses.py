"""Label-smoothed cross entropy over non-pad tokens (Vaswani et al., 2017, section 5.4).

The smoothing follows `torch.nn.functional.cross_entropy(label_smoothing=eps)`: the target
distribution is (1 - eps) on the gold token plus eps / V spread over the whole vocabulary.
The loss is a mean over non-pad tokens, so it does not depend on how much padding a batch carries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TokenLoss", "label_smoothed_cross_entropy", "linear_label_smoothed_cross_entropy", "symmetric_kl"]


class TokenLoss(NamedTuple):
    """Per-batch loss terms, all means over the `n_tokens` non-pad target tokens."""

    loss: Tensor  # label-smoothed cross entropy: what is optimized
    nll: Tensor  # plain negative log-likelihood: exp(nll) is the perplexity
    n_correct: Tensor  # number of tokens whose argmax is the gold token (a tie with it counts)
    n_tokens: Tensor  # number of non-pad tokens (long)


# Logits elements handled at once in eager mode, by device type. On the CPU it bounds the float32 temporaries
# of the forward and backward passes to 64 MiB whatever N and V; up to this size the loss runs in one piece.
# Smaller chunks that stay in cache were faster on one thread, but each chunk costs every kernel a parallel
# region, and on the loaded 2-core machine (threads waiting for each other) 1M-element chunks were 2-3x
# slower than one piece (benchmarks/train/bench_loss.py --chunks); at 16M elements both as fast as one piece.
# On a GPU the chunk was first sized for the L2 cache (4M elements, ~220 chunks at 28k x 32k, ~8 launches
# each), but there the launches dominated: the loss's host time exceeded its kernels' time. Measured on an
# H200 (torch 2.11, WMT-base bf16 step, 50k tokens, benchmarks/results/gpu/2026-11-27_h200_gpu_profile.txt):
# 4M-element chunks 3407 kernels and 0.086 s a step, 64M-element chunks (256 MiB per float32 temporary,
# ~14 chunks) 1636 kernels and 0.076 s. The extra trips to memory cost less than the launches they save.
_CHUNK_ELEMENTS = 1 << 24
_CHUNK_ELEMENTS_BY_DEVICE = {"cuda": 1 << 26}
# Devices on which the gradient's rows are written by one addcmul (`_write_grad_rows`).
_ONE_KERNEL_GRAD_WRITE = frozenset({"cuda"})
# Devices on which the fused loss's per-chunk terms (`_chunk_terms`) run as one compiled region
# (`torch.compile`, Inductor): in eager PyTorch the float32 log-softmax, its exp_, mul_, sub_, the gold
# scatter and the rounding to the logits' dtype are separate passes over each chunk, so on a GPU the fused
# loss moved more bytes than the plain one (counted at the WMT-base shape: the loss region 68.6 GB against
# 51.0, benchmarks/gpu/bytes_per_step.py --fused-loss); compiled, the logits are read by the reductions and
# the gradient written once. The CPU keeps the eager chunk (no compile time, nothing to gain on 2 cores).
_COMPILED_CHUNK_DEVICES = frozenset({"cuda"})
_CHUNK_BACKEND = "inductor"


def _row_chunks(n_rows: int, vocab: int, device: torch.device) -> list[slice]:
    """Row slices covering `n_rows` rows of `vocab` columns, at most the device's chunk of elements each.

    Under `torch.compile` one slice: a Python loop over a symbolic N would specialize the graph on N
    (a recompile per batch shape), and the compiler fuses the softmax into its reductions anyway, so the
    float32 (N, V) intermediates are not materialized there.
    """
    elements = _CHUNK_ELEMENTS_BY_DEVICE.get(device.type, _CHUNK_ELEMENTS)
    if torch.compiler.is_compiling() or n_rows * vocab <= elements:
        return [slice(None)]
    rows = max(1, elements // vocab)
    return [slice(start, start + rows) for start in range(0, n_rows, rows)]


def _forward_rows(logits: Tensor, gold: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """log p(gold), sum_v log p(v) and max_v log p(v) of each row of logits (n, V), gold (n,): (n,) each.

    The logits are read once (16-bit ones upcast to `dtype` on the way: the log-sum-exp over V needs float32
    range); the three reductions read the float32 chunk, which on a GPU is still in the L2 cache.
    """
    lprobs = F.log_softmax(logits, dim=-1, dtype=dtype)  # (n, V)
    return lprobs.gather(-1, gold.unsqueeze(-1)).squeeze(-1), lprobs.sum(dim=-1), lprobs.amax(dim=-1)


def _write_grad_rows(logits: Tensor, scale: Tensor, shift: Tensor, out: Tensor, dtype: torch.dtype) -> None:
    """out = softmax(logits) * scale + shift for logits (n, V), scale and shift (n,), into `out` (n, V).

    The logits are read once (upcast to `dtype`, float32 or wider) and `out` (a row slice of the gradient,
    in the logits' dtype) is written once, rounded once from float32. A float32 gradient holds the softmax
    itself (no temporary); a 16-bit one needs a float32 chunk. On a GPU one `addcmul` then scales, shifts
    and casts; the CPU's addcmul with per-row factors (and its float32 -> 16-bit output) is not vectorized,
    3-7x slower there than the in-place mul_, add_ and a copy.
    """
    probs = torch.softmax(logits, dim=-1, dtype=dtype, out=out if out.dtype == dtype else None)  # (n, V)
    if out.device.type in _ONE_KERNEL_GRAD_WRITE:
        torch.addcmul(shift.unsqueeze(-1), probs, scale.unsqueeze(-1), out=out)
        return
    probs.mul_(scale.unsqueeze(-1)).add_(shift.unsqueeze(-1))
    if probs is not out:
        out.copy_(probs)


class _LabelSmoothedNLL(torch.autograd.Function):
    """Per-token label-smoothed loss and NLL from one log-softmax, and whether the gold token is the argmax.

    loss_i = -(1 - eps) * log p(y_i) - eps * mean_v log p(v);  nll_i = -log p(y_i). The gradient of
    g_loss * loss + g_nll * nll w.r.t. the logits is softmax * (g_loss + g_nll) - g_loss * eps / V
    - onehot(y) * ((1 - eps) * g_loss + g_nll): the softmax minus the target distribution, scaled.

    Passes over the padded (N, V) logits: the forward reads them once, the backward reads them once and
    writes the gradient (in the logits' dtype) once (a float32 gradient doubles as the softmax's buffer:
    written twice, read once); everything else works on float32 chunks of rows (`_row_chunks`) or on
    per-token vectors. The gold column's gradient is written by one `index_put_` of N
    values after the chunks, from log p(y) kept from the forward pass. Between forward and backward only the
    logits themselves (which exist anyway), the gold indices and log p(y) are kept: no float32 (N, V) copy
    of bf16/fp16 logits lives until the backward pass.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, gold: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        chunks = _row_chunks(logits.size(0), logits.size(-1), logits.device)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        if len(chunks) == 1:
            gold_lprobs, sums, maxes = _forward_rows(logits, gold, dtype)  # (N,) each
        else:
            parts = [_forward_rows(logits[rows], gold[rows], dtype) for rows in chunks]
            gold_lprobs, sums, maxes = (torch.cat(column) for column in zip(*parts))  # (N,) each
        nll = -gold_lprobs
        # (1 - eps) * nll + eps * smooth, smooth = -sums / V: the cross entropy against the uniform
        loss = torch.add(nll * (1.0 - eps), sums, alpha=-eps / logits.size(-1))
        # argmax == gold via the row max (argmax over V is several times slower); a tie counts as correct
        is_top = gold_lprobs >= maxes
        ctx.save_for_backward(logits, gold, gold_lprobs)
        ctx.eps = eps
        ctx.mark_non_differentiable(is_top)
        ctx.set_materialize_grads(False)  # no zeros for is_top's (or an unused output's) gradient
        return loss, nll, is_top

    @staticmethod
    def backward(
        ctx: Any, grad_loss: Tensor | None, grad_nll: Tensor | None, _: Tensor | None
    ) -> tuple[Tensor | None, None, None]:
        logits, gold, gold_lprobs = ctx.saved_tensors
        if grad_loss is None and grad_nll is None:
            return None, None, None
        grad_loss = torch.zeros_like(gold_lprobs) if grad_loss is None else grad_loss
        grad_nll = torch.zeros_like(gold_lprobs) if grad_nll is None else grad_nll
        eps, vocab = ctx.eps, logits.size(-1)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        scale = grad_loss + grad_nll  # (N,) the softmax's factor
        shift = grad_loss * (-eps / vocab)  # (N,) the uniform part of the target distribution
        grad = torch.empty_like(logits)  # (N, V) in the logits' dtype: the only full-size buffer
        for rows in _row_chunks(logits.size(0), vocab, logits.device):
            _write_grad_rows(logits[rows], scale[rows], shift[rows], grad[rows], dtype)
        # the gold column: the same softmax * scale + shift, minus the one-hot part, rounded once
        one_hot = torch.add(grad_nll, grad_loss, alpha=1.0 - eps)  # (N,)
        gold_grad = torch.addcmul(shift, gold_lprobs.exp(), scale).sub_(one_hot)
        # (index_put_, not scatter_: the CPU's 16-bit scatter_ makes a float32 copy of all of `grad`)
        grad.index_put_((torch.arange(gold.numel(), device=gold.device), gold), gold_grad.to(grad.dtype))
        return grad, None, None


def label_smoothed_cross_entropy(
    logits: Tensor, target: Tensor, *, ignore_index: int = 0, label_smoothing: float = 0.1
) -> TokenLoss:
    """Cross entropy of `logits` (..., V) against `target` (...), skipping `target == ignore_index`.

    One log-softmax (in at least float32, also under autocast) gives both the smoothed loss and the NLL,
    with a hand-written backward pass (`_LabelSmoothedNLL`).
    A batch with no target token returns zeros, not NaN (torch's mean would divide by zero).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} do not match")
    V = logits.size(-1)
    logits = logits.reshape(-1, V)  # (N, V), N = all positions
    target = target.reshape(-1)  # (N,)
    ignored = target == ignore_index  # (N,)
    keep = ~ignored
    gold = target.masked_fill(ignored, 0)  # a valid index at ignored positions; their terms are zeroed
    per_token, nll, is_top = _LabelSmoothedNLL.apply(logits, gold, label_smoothing)  # (N,) each
    n_tokens = keep.sum()
    denominator = n_tokens.clamp(min=1).to(nll.dtype)
    n_correct = (is_top & keep).sum()
    return TokenLoss(
        loss=per_token.masked_fill(ignored, 0.0).sum() / denominator,
        nll=nll.masked_fill(ignored, 0.0).sum() / denominator,
        n_correct=n_correct,
        n_tokens=n_tokens,
    )


class _LinearLabelSmoothedCE(torch.autograd.Function):
    """The output projection and the label-smoothed loss in one pass over row chunks, gradients included.

    For each chunk of rows: logits = hidden @ W^T + b in the compute dtype, their log-softmax in float32,
    the loss terms, and at once the gradient of the weighted loss sum_i w_i loss_i (w: 1 / n_tokens at
    real tokens, 0 at ignored ones) w.r.t. the logits, softmax * w - w eps / V - onehot * w (1 - eps),
    which the two matrix products turn into the gradients of hidden, W and b. No (N, V) tensor outlives
    its chunk: neither the logits nor their gradient is ever whole (Liger Kernel's and torch's fused linear
    cross entropy do the same). The backward pass only scales the stored gradients by the incoming one,
    so only the loss is differentiable; the NLL and the argmax flags are reported, not differentiated.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        gold: Tensor,
        token_weights: Tensor,
        eps: float,
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor, Tensor]:
        N, V = hidden.size(0), weight.size(0)
        stats_dtype = torch.promote_types(dtype, torch.float32)
        h, w = hidden.to(dtype), weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        grad_hidden = torch.empty_like(hidden)  # (N, D)
        grad_weight = torch.zeros(weight.shape, dtype=stats_dtype, device=weight.device)  # (V, D)
        grad_bias = None if bias is None else torch.zeros(V, dtype=stats_dtype, device=weight.device)
        gold_lprobs, sums, maxes = (torch.empty(N, dtype=stats_dtype, device=hidden.device) for _ in range(3))
        terms = _chunk_terms_on(hidden.device)
        for rows in _row_chunks(N, V, hidden.device):
            logits = F.linear(h[rows], w, b)  # (n, V)
            stats = terms(logits, gold[rows], token_weights[rows], eps)
            gold_lprobs[rows], sums[rows], maxes[rows], grad = stats
            grad_hidden[rows] = grad @ w
            grad_weight.add_(grad.t() @ h[rows])
            if grad_bias is not None:
                grad_bias.add_(grad.sum(dim=0, dtype=stats_dtype))
        nll = -gold_lprobs
        loss = torch.add(nll * (1.0 - eps), sums, alpha=-eps / V)  # (N,)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype), grad_bias)
        ctx.has_bias = bias is not None
        ctx.mark_non_differentiable(nll, gold_lprobs)
        return (loss * token_weights.to(loss.dtype)).sum(), nll, gold_lprobs >= maxes

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *_: Tensor | None) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        return (
            grad_hidden * grad_loss.to(grad_hidden.dtype),
            grad_weight * grad_loss.to(grad_weight.dtype),
            grad_bias * grad_loss.to(grad_bias.dtype) if ctx.has_bias else None,
            None,
            None,
            None,
            None,
        )


def _chunk_terms(
    logits: Tensor, gold: Tensor, token_weights: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk of `_LinearLabelSmoothedCE`: logits (n, V) in the compute dtype, gold (n,), the tokens'
    weights w (n,) -> log p(gold), sum_v log p(v), max_v log p(v) (n,) in float32 (or wider), and the
    gradient of sum_i w_i loss_i w.r.t. the logits, softmax * w - w eps / V - onehot * w (1 - eps), in the
    logits' dtype (rounded once)."""
    stats_dtype = torch.promote_types(logits.dtype, torch.float32)
    lprobs = F.log_softmax(logits, dim=-1, dtype=stats_dtype)  # (n, V)
    gold_rows = gold.unsqueeze(-1)  # (n, 1)
    gold_lprobs = lprobs.gather(-1, gold_rows).squeeze(-1)
    sums, maxes = lprobs.sum(dim=-1), lprobs.amax(dim=-1)
    scale = token_weights.to(stats_dtype).unsqueeze(-1)  # (n, 1)
    grad = lprobs.exp_().mul_(scale).sub_(scale * (eps / logits.size(-1)))  # softmax * w - w eps / V
    grad.scatter_add_(-1, gold_rows, -(1.0 - eps) * scale)  # - onehot * w (1 - eps)
    return gold_lprobs, sums, maxes, grad.to(logits.dtype)


@functools.cache
def _compiled_chunk_terms(backend: str) -> Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]:
    return torch.compile(_chunk_terms, backend=backend, fullgraph=True, dynamic=True)


def _chunk_terms_on(device: torch.device) -> Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]:
    """`_chunk_terms`, compiled (one graph, dynamic in the chunk's rows: the last chunk and every batch
    size reuse it) on the devices of `_COMPILED_CHUNK_DEVICES`, else eager (and on CUDA without Triton,
    which Inductor's GPU kernels need)."""
    if device.type in _COMPILED_CHUNK_DEVICES and (device.type != "cuda" or _has_triton()):
        return _compiled_chunk_terms(_CHUNK_BACKEND)
    return _chunk_terms


@functools.cache
def _has_triton() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def linear_label_smoothed_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    *,
    ignore_index: int = 0,
    label_smoothing: float = 0.1,
) -> TokenLoss:
    """`label_smoothed_cross_entropy(F.linear(hidden, weight, bias), target, ...)` without the logits:
    hidden (..., D), weight (V, D), bias (V,) or None, target (...). The projection runs in the autocast
    dtype under autocast (as `F.linear` would), the softmax statistics in float32; the gradients are formed
    in the forward pass (`_LinearLabelSmoothedCE`), so the loss is the one differentiable output."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} do not match")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    hidden, target = hidden.reshape(-1, hidden.size(-1)), target.reshape(-1)  # (N, D), (N,)
    ignored = target == ignore_index  # (N,)
    keep = ~ignored
    n_tokens = keep.sum()
    denominator = n_tokens.clamp(min=1)
    token_weights = keep / denominator  # (N,) 1 / n_tokens at real tokens: the mean's weights
    gold = target.masked_fill(ignored, 0)
    with torch.autocast(device, enabled=False):
        loss, nll, is_top = _LinearLabelSmoothedCE.apply(
            hidden, weight, bias, gold, token_weights, label_smoothing, dtype
        )
    return TokenLoss(
        loss=loss,
        nll=(nll.masked_fill(ignored, 0.0).sum() / denominator.to(nll.dtype)),
        n_correct=(is_top & keep).sum(),
        n_tokens=n_tokens,
    )


def symmetric_kl(logits_p: Tensor, logits_q: Tensor) -> Tensor:
    """(KL(p || q) + KL(q || p)) / 2 between the softmaxes of two (N, C) logits, averaged over the N rows:
    R-Drop's consistency term (Liang et al., 2021), in float32. Gradients flow into both sides."""
    log_p = F.log_softmax(logits_p.float(), dim=-1)  # (N, C)
    log_q = F.log_softmax(logits_q.float(), dim=-1)  # (N, C)
    # sum_c (p - q)(log p - log q) = KL(p || q) + KL(q || p)
    return ((log_p.exp() - log_q.exp()) * (log_p - log_q)).sum(dim=-1).mean() / 2
