"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), from scratch on PyTorch."""

from transformer.attention import KVCache, MultiHeadAttention, make_causal_mask
from transformer.config import TransformerConfig
from transformer.layers import DecoderLayer, EncoderLayer, FeedForward
from transformer.model import Decoder, DecoderCache, Encoder, Seq2SeqTransformer, TransformerClassifier
from transformer.positional import LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding
from transformer.search.decoding import beam_search, greedy_search

__all__ = [
    "Decoder",
    "DecoderCache",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "Seq2SeqTransformer",
    "SinusoidalPositionalEncoding",
    "TransformerClassifier",
    "TransformerConfig",
    "beam_search",
    "greedy_search",
    "make_causal_mask",
]
