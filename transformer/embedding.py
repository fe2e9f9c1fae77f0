"""Input embeddings (Vaswani et al., 2017, Sections 3.4-3.5) and the model builders' shared parts: the
positional modules a `TransformerConfig` names and the initialisation of the weights.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from transformer.config import TransformerConfig
from transformer.dropout import Dropout
from transformer.norm import LayerNorm, autocast_dtype
from transformer.packing import TokenPacking
from transformer.positional import RotaryEmbedding, build_absolute_positional

__all__ = ["Embedder", "build_positional", "build_rotary", "init_weights"]


class Embedder(nn.Module):
    """Token embedding * sqrt(D) (Section 3.4), plus absolute positions (Section 3.5), then dropout; with
    `in_autocast_dtype` set, under autocast, cast to the autocast dtype before the dropout (the residual
    stream in low precision: `transformer.norm`).

    Two options serve BERT-family encoders (`TransformerConfig.scale_embedding`, `embedding_norm`):
    `scale=False` adds the token embeddings unscaled, and `norm=True` puts a LayerNorm (epsilon
    `norm_eps`) on the sum, before the dropout."""

    in_autocast_dtype: bool = False

    def __init__(
        self,
        embedding: nn.Embedding,
        positional: nn.Module | None,
        dropout: float,
        *,
        scale: bool = True,
        norm: bool = False,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.positional = positional
        self.scale = math.sqrt(embedding.embedding_dim) if scale else 1.0
        # absent, not an identity, when off: the state dict of every checkpoint without it stays as it was
        self.norm = LayerNorm(embedding.embedding_dim, eps=norm_eps) if norm else None
        self.dropout = Dropout(dropout)

    @classmethod
    def of(cls, config: TransformerConfig, embedding: nn.Embedding, positional: nn.Module | None) -> Embedder:
        """The embedder `config` describes, around an embedding and positions the model builder owns."""
        return cls(
            embedding,
            positional,
            config.dropout,
            scale=config.scale_embedding,
            norm=config.embedding_norm,
            norm_eps=config.norm_eps,
        )

    def forward(
        self, tokens: Tensor, offset: int | Tensor = 0, packing: TokenPacking | None = None
    ) -> Tensor:
        """tokens (B, T) long at positions offset .. offset+T-1 -> (B, T, D), or (N, D) for the
        positions that `packing` keeps."""
        if packing is None:
            x = self._scaled(self.embedding(tokens))  # (B, T, D)
            if self.positional is not None:
                x = self.positional(x, offset)
            return self.dropout(self._stream_dtype(self._normed(x)))
        x = self._scaled(self.embedding(packing.pack(tokens)))  # (N, D)
        if self.positional is not None:
            # the encodings of positions offset .. offset+T-1 (the module adds them to zeros), then per token
            table = self.positional(x.new_zeros(1, packing.length, x.size(-1)), offset)[0]  # (T, D)
            x = x + table.index_select(0, packing.positions)  # (N, D)
        return self.dropout(self._stream_dtype(self._normed(x)))

    def _scaled(self, x: Tensor) -> Tensor:
        return x * self.scale if self.scale != 1.0 else x  # unscaled: the looked-up tensor itself

    def _normed(self, x: Tensor) -> Tensor:
        return x if self.norm is None else self.norm(x)

    def _stream_dtype(self, x: Tensor) -> Tensor:
        dtype = autocast_dtype(x) if self.in_autocast_dtype else None
        return x if dtype is None else x.to(dtype)


def build_positional(config: TransformerConfig) -> nn.Module | None:
    return build_absolute_positional(config.positional, config.d_model, config.max_len)


def build_rotary(config: TransformerConfig) -> RotaryEmbedding | None:
    return RotaryEmbedding(config.d_head, config.max_len) if config.positional == "rope" else None


def init_weights(module: nn.Module) -> None:
    """Xavier-uniform matrices and zero biases, as the paper's reference code (tensor2tensor) does for its
    dense layers; with `config.embedding_init == "normal"` the token embeddings (and an output projection
    tied to them) are then drawn from N(0, d_model^-0.5), as tensor2tensor and fairseq draw them."""
    for name, param in module.named_parameters():
        if param.dim() > 1:
            nn.init.xavier_uniform_(param)
        elif name.endswith("bias"):
            nn.init.zeros_(param)
    if module.config.embedding_init == "normal":
        for embedder in module.modules():
            if isinstance(embedder, Embedder):
                nn.init.normal_(embedder.embedding.weight, std=embedder.embedding.embedding_dim**-0.5)
