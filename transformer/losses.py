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


class _LabelSmoothedNLL(torch.autograd.Function):
    """Per-token label-smoothed loss and NLL from one log-softmax, and whether the gold token is the argmax.

    loss_i = -(1 - eps) * log p(y_i) - eps * mean_v log p(v);  nll_i = -log p(y_i). The gradient of
    g_loss * loss + g_nll * nll w.r.t. the logits is softmax * (g_loss + g_nll) - g_loss * eps / V
    - onehot(y) * ((1 - eps) * g_loss + g_nll): three passes over one new (N, V) buffer, instead of
    autograd's chain of mean, gather and log-softmax backward passes and their temporaries.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, gold: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        # half-precision logits (autocast) are promoted: the log-sum-exp over V needs float32 range
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lprobs = F.log_softmax(logits, dim=-1, dtype=dtype)  # (N, V)
        gold_lprobs = lprobs.gather(-1, gold.unsqueeze(-1)).squeeze(-1)  # (N,)
        smooth = -lprobs.mean(dim=-1)  # (N,) cross entropy against the uniform distribution
        # argmax == gold, via a max (a vectorized reduction; argmax over V is several times slower);
        # an exact tie with the gold token counts as correct
        is_top = gold_lprobs >= lprobs.amax(dim=-1)  # (N,) bool
        ctx.save_for_backward(lprobs, gold)
        ctx.eps, ctx.logits_dtype = eps, logits.dtype
        ctx.mark_non_differentiable(is_top)
        return (1.0 - eps) * -gold_lprobs + eps * smooth, -gold_lprobs, is_top

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor, _: Tensor) -> tuple[Tensor, None, None]:
        lprobs, gold = ctx.saved_tensors
        eps, vocab = ctx.eps, lprobs.size(-1)
        grad = lprobs.exp().mul_((grad_loss + grad_nll).unsqueeze(-1))  # (N, V) softmax * (g_loss + g_nll)
        if eps:
            grad.sub_((grad_loss * (eps / vocab)).unsqueeze(-1))
        grad.scatter_add_(-1, gold.unsqueeze(-1), -((1.0 - eps) * grad_loss + grad_nll).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


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
