"""Label-smoothed cross entropy over non-pad tokens (Vaswani et al., 2017, section 5.4).

The smoothing follows `torch.nn.functional.cross_entropy(label_smoothing=eps)`: the target
distribution is (1 - eps) on the gold token plus eps / V spread over the whole vocabulary.
The loss is a mean over non-pad tokens, so it does not depend on how much padding a batch carries.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TokenLoss", "label_smoothed_cross_entropy"]


class TokenLoss(NamedTuple):
    """Per-batch loss terms, all means over the `n_tokens` non-pad target tokens."""

    loss: Tensor  # label-smoothed cross entropy: what is optimized
    nll: Tensor  # plain negative log-likelihood: exp(nll) is the perplexity
    n_correct: Tensor  # number of tokens whose argmax is the gold token
    n_tokens: Tensor  # number of non-pad tokens (long)


def label_smoothed_cross_entropy(
    logits: Tensor, target: Tensor, *, ignore_index: int = 0, label_smoothing: float = 0.1
) -> TokenLoss:
    """Cross entropy of `logits` (..., V) against `target` (...), skipping `target == ignore_index`.

    One log-softmax (in at least float32, also under autocast) gives both the smoothed loss and the NLL.
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
    # half-precision logits (autocast) are promoted: the log-sum-exp over V needs float32 range
    lprobs = F.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # (N, V)
    nll = -lprobs.gather(-1, gold.unsqueeze(-1)).squeeze(-1)  # (N,)
    smooth = -lprobs.mean(dim=-1)  # (N,) cross entropy against the uniform distribution
    per_token = (1.0 - label_smoothing) * nll + label_smoothing * smooth  # (N,)
    n_tokens = keep.sum()
    denominator = n_tokens.clamp(min=1).to(lprobs.dtype)
    with torch.no_grad():
        n_correct = ((logits.argmax(dim=-1) == target) & keep).sum()
    return TokenLoss(
        loss=per_token.masked_fill(~keep, 0.0).sum() / denominator,
        nll=nll.masked_fill(~keep, 0.0).sum() / denominator,
        n_correct=n_correct,
        n_tokens=n_tokens,
    )
