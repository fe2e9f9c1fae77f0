"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), from scratch on PyTorch."""

from transformer.attention import KVCache, MultiHeadAttention, make_causal_mask

__all__ = ["KVCache", "MultiHeadAttention", "make_causal_mask"]
