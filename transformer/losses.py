"""Label-smoothed cross entropy over non-pad tokens (Vaswani et al., 2017, section 5.4).

The smoothing follows `torch.nn.functional.cross_entropy(label_smoothing=eps)`: the target
distribution is (1 - eps) on the gold token plus eps / V spread over the whole vocabulary.
The loss is a mean over non-pad tokens, so it does not depend on how much padding a batch carries.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TokenLoss", "label_smoothed_cross_entropy", "symmetric_kl"]


class TokenLoss(NamedTuple):
    """Per-batch loss terms, all means over the `n_tokens` non-pad target tokens."""

    loss: Tensor  # label-smoothed cross entropy: what is optimized
    nll: Tensor  # plain negative log-likelihood: exp(nll) is the perplexity
    n_correct: Tensor  # number of tokens whose argmax is the gold token (a tie with it counts)
    n_tokens: Tensor  # number of non-pad tokens (long)


# Logits elements handled at once in eager mode: bounds the float32 temporaries of the forward and backward
# passes to 64 MiB whatever N and V; up to this size the loss runs in one piece. Smaller chunks that stay in
# cache were faster on one thread, but each chunk costs every kernel a parallel region, and on the loaded
# 2-core machine (threads waiting for each other) 1M-element chunks were 2-3x slower than one piece
# (benchmarks/bench_loss.py --chunks); at 16M elements both are as fast as one piece.
_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(n_rows: int, vocab: int) -> list[slice]:
    """Row slices covering `n_rows` rows of `vocab` columns, at most `_CHUNK_ELEMENTS` elements each.

    Under `torch.compile` one slice: a Python loop over a symbolic N would specialize the graph on N
    (a recompile per batch shape), and the compiler fuses the softmax into its reductions anyway, so the
    float32 (N, V) intermediates are not materialized there.
    """
    if torch.compiler.is_compiling() or n_rows * vocab <= _CHUNK_ELEMENTS:
        return [slice(None)]
    rows = max(1, _CHUNK_ELEMENTS // vocab)
    return [slice(start, start + rows) for start in range(0, n_rows, rows)]


def _forward_rows(logits: Tensor, gold: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row smoothed loss, NLL and is-the-gold-token-the-argmax of logits (n, V), gold (n,)."""
    # half-precision logits (autocast) are promoted: the log-sum-exp over V needs float32 range
    lprobs = F.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # (n, V)
    gold_lprobs = lprobs.gather(-1, gold.unsqueeze(-1)).squeeze(-1)  # (n,)
    smooth = -lprobs.mean(dim=-1)  # (n,) cross entropy against the uniform distribution
    # argmax == gold, via a max (a vectorized reduction; argmax over V is several times slower);
    # an exact tie with the gold token counts as correct
    is_top = gold_lprobs >= lprobs.amax(dim=-1)  # (n,) bool
    return (1.0 - eps) * -gold_lprobs + eps * smooth, -gold_lprobs, is_top


def _grad_rows(
    logits: Tensor, gold: Tensor, grad_loss: Tensor, grad_nll: Tensor, eps: float, out: Tensor | None = None
) -> Tensor:
    """d(g_loss * loss + g_nll * nll) / d logits for logits (n, V), in at least float32: (n, V), written
    into `out` when given (a float32 view of the gradient buffer, which saves a copy)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    grad = torch.softmax(logits, dim=-1, dtype=dtype, out=out)  # (n, V), recomputed, not kept from forward
    grad.mul_((grad_loss + grad_nll).unsqueeze(-1))  # softmax * (g_loss + g_nll)
    if eps:
        grad.sub_((grad_loss * (eps / logits.size(-1))).unsqueeze(-1))
    return grad.scatter_add_(-1, gold.unsqueeze(-1), -((1.0 - eps) * grad_loss + grad_nll).unsqueeze(-1))


class _LabelSmoothedNLL(torch.autograd.Function):
    """Per-token label-smoothed loss and NLL from one log-softmax, and whether the gold token is the argmax.

    loss_i = -(1 - eps) * log p(y_i) - eps * mean_v log p(v);  nll_i = -log p(y_i). The gradient of
    g_loss * loss + g_nll * nll w.r.t. the logits is softmax * (g_loss + g_nll) - g_loss * eps / V
    - onehot(y) * ((1 - eps) * g_loss + g_nll), written straight into one (N, V) buffer of the logits'
    dtype. Between forward and backward only the logits themselves (which exist anyway) and the gold
    indices are kept: no float32 (N, V) copy of bf16/fp16 logits lives until the backward pass. Both
    passes work in float32 on chunks of rows (`_row_chunks`), so their temporaries stay small too.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, gold: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        chunks = _row_chunks(logits.size(0), logits.size(-1))
        if len(chunks) == 1:
            loss, nll, is_top = _forward_rows(logits, gold, eps)  # (N,) each
        else:
            parts = [_forward_rows(logits[rows], gold[rows], eps) for rows in chunks]
            loss, nll, is_top = (torch.cat(column) for column in zip(*parts))  # (N,) each
        ctx.save_for_backward(logits, gold)
        ctx.eps = eps
        ctx.mark_non_differentiable(is_top)
        return loss, nll, is_top

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor, _: Tensor) -> tuple[Tensor, None, None]:
        logits, gold = ctx.saved_tensors
        chunks = _row_chunks(logits.size(0), logits.size(-1))
        if len(chunks) == 1:
            return _grad_rows(logits, gold, grad_loss, grad_nll, ctx.eps).to(logits.dtype), None, None
        grad = torch.empty_like(logits)  # (N, V) in the logits' dtype: the only full-size buffer
        in_place = grad.dtype == torch.promote_types(grad.dtype, torch.float32)
        for rows in chunks:
            out = grad[rows] if in_place else None  # float32 or wider: computed in place
            chunk = _grad_rows(logits[rows], gold[rows], grad_loss[rows], grad_nll[rows], ctx.eps, out)
            if not in_place:
                grad[rows] = chunk  # one rounding from float32 to the logits' dtype
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
    keep = target != ignore_index  # (N,)
    gold = target.masked_fill(~keep, 0)  # a valid index at ignored positions; their terms are zeroed
    per_token, nll, is_top = _LabelSmoothedNLL.apply(logits, gold, label_smoothing)  # (N,) each
    n_tokens = keep.sum()
    denominator = n_tokens.clamp(min=1).to(nll.dtype)
    n_correct = (is_top & keep).sum()
    return TokenLoss(
        loss=per_token.masked_fill(~keep, 0.0).sum() / denominator,
        nll=nll.masked_fill(~keep, 0.0).sum() / denominator,
        n_correct=n_correct,
        n_tokens=n_tokens,
    )


def symmetric_kl(logits_p: Tensor, logits_q: Tensor) -> Tensor:
    """(KL(p || q) + KL(q || p)) / 2 between the softmaxes of two (N, C) logits, averaged over the N rows:
    R-Drop's consistency term (Liang et al., 2021), in float32. Gradients flow into both sides."""
    log_p = F.log_softmax(logits_p.float(), dim=-1)  # (N, C)
    log_q = F.log_softmax(logits_q.float(), dim=-1)  # (N, C)
    # sum_c (p - q)(log p - log q) = KL(p || q) + KL(q || p)
    return ((log_p.exp() - log_q.exp()) * (log_p - log_q)).sum(dim=-1).mean() / 2
