"""Position-wise feed-forward network and the encoder / decoder layers (the paper, Section 3.1-3.3).

Every attention is the one `MultiHeadAttention`; post-LN (the paper) or pre-LN via `norm_first`.
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Section 3.3); GELU, or SwiGLU (Shazeer, 2020) on request.

    SwiGLU gates with a third matrix: (silu(x W1) * x W3) W2; pick d_ff about 2/3 of the ReLU one to
    keep the parameter count.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        dropout: float = 0.1,
        activation: Literal["relu", "gelu", "swiglu"] = "relu",
    ) -> None:
        super().__init__()
        if activation not in ("relu", "gelu", "swiglu"):
            raise ValueError(f"activation must be one of ['relu', 'gelu', 'swiglu'], got {activation!r}")
        self.activation = activation
        self.linear1 = nn.Linear(d_model, d_ff)
        self.gate = nn.Linear(d_model, d_ff) if activation == "swiglu" else None
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T, D) -> (B, T, D)."""
        hidden = self.linear1(x)  # (B, T, d_ff)
        if self.gate is not None:
            hidden = F.silu(hidden) * self.gate(x)
        elif self.activation == "gelu":
            hidden = F.gelu(hidden)
        else:
            hidden = F.relu(hidden)
        return self.linear2(self.dropout(hidden))
