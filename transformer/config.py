"""`TransformerConfig`: the architecture's hyperparameters as plain, validated, typed data.

Defaults are the paper's base model (Vaswani et al., 2017, Table 3, row "base").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Activation = Literal["relu", "gelu", "silu", "swiglu"]
Positional = Literal["sinusoidal", "learned", "rope"]
TieEmbeddings = Literal["none", "decoder", "all"]
EmbeddingInit = Literal["xavier", "normal"]

ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "silu", "swiglu")
POSITIONALS: tuple[str, ...] = ("sinusoidal", "learned", "rope")
TIE_EMBEDDINGS: tuple[str, ...] = ("none", "decoder", "all")
EMBEDDING_INITS: tuple[str, ...] = ("xavier", "normal")


@dataclass
class TransformerConfig:
    """Shape of an encoder-decoder (or encoder-only) Transformer; checked in `__post_init__`.

    `tgt_vocab_size=None` means "same as the source" (a joint vocabulary, or an encoder-only model).
    `tie_embeddings`: "none"; "decoder" = the decoder's input embedding is the output projection
    (Press & Wolf, 2017); "all" = the encoder's embedding is that same matrix too (the paper's
    Section 3.4, which needs one shared vocabulary).
    `activation`: the feed-forward's nonlinearity; "silu" (swish) is OPUS-MT's (Marian), "swiglu" a gated
    feed-forward (Shazeer, 2020). `output_bias`: a bias on the output projection (Marian's
    `final_logits_bias`). `bos_id` is the token the decoder starts from; it may be the pad token, as in
    Marian's models, which have no BOS (the decoder never masks its own inputs, only the source's pads).
    `scale_embedding`: multiply the token embeddings by sqrt(d_model) (Section 3.4; BERT does not);
    `embedding_norm`: a LayerNorm on token + position embeddings, before the dropout (BERT's); `norm_eps`:
    the epsilon of every LayerNorm (torch's 1e-5; BERT's 1e-12). The defaults are the paper's model, which
    every checkpoint written before these options has.
    """

    src_vocab_size: int
    tgt_vocab_size: int | None = None
    d_model: int = 512
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1  # residual, embedding and feed-forward hidden dropout (P_drop)
    attention_dropout: float = 0.0  # dropout on the attention weights (the paper uses none)
    activation: Activation = "relu"
    norm_first: bool = False  # False = post-LN as in the paper; True = pre-LN, steadier for deep stacks
    positional: Positional = "sinusoidal"
    max_len: int = 512  # longest sequence (source, or target including BOS) the model accepts
    tie_embeddings: TieEmbeddings = "all"
    output_bias: bool = False
    # "xavier": like every other matrix; "normal": N(0, d_model^-0.5), so that the sqrt(d_model) scaling gives
    # the token embeddings unit variance, on a par with the positional encodings (tensor2tensor, fairseq)
    embedding_init: EmbeddingInit = "xavier"
    scale_embedding: bool = True
    embedding_norm: bool = False
    norm_eps: float = 1e-5
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self) -> None:
        if self.tgt_vocab_size is None:
            self.tgt_vocab_size = self.src_vocab_size
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "n_encoder_layers", "d_ff"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("n_decoder_layers", self.n_decoder_layers, minimum=0)  # 0 = encoder-only
        _check_int("max_len", self.max_len, minimum=2)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}): "
                "each head gets d_model / n_heads dimensions"
            )
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("positional", self.positional, POSITIONALS)
        _check_choice("tie_embeddings", self.tie_embeddings, TIE_EMBEDDINGS)
        _check_choice("embedding_init", self.embedding_init, EMBEDDING_INITS)
        if not isinstance(self.norm_first, bool):
            raise ValueError(f"norm_first must be a bool, got {self.norm_first!r}")
        if self.positional == "rope" and self.d_head % 2:
            raise ValueError(
                f"positional='rope' needs an even head dimension, got d_model / n_heads = {self.d_head}"
            )
        if self.tie_embeddings == "all" and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                f"tie_embeddings='all' shares one embedding matrix, so it needs src_vocab_size "
                f"({self.src_vocab_size}) == tgt_vocab_size ({self.tgt_vocab_size}); "
                "use tie_embeddings='decoder' or 'none' for separate vocabularies"
            )
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            _check_int(name, value, minimum=0)
            smallest_vocab = min(self.src_vocab_size, self.tgt_vocab_size)
            if value >= smallest_vocab:
                raise ValueError(f"{name} ({value}) must be below the vocabulary size ({smallest_vocab})")
        if self.eos_id in (self.pad_id, self.bos_id):
            raise ValueError(
                f"eos_id ({self.eos_id}) must differ from pad_id ({self.pad_id}) and bos_id ({self.bos_id})"
            )
        for name in ("output_bias", "scale_embedding", "embedding_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        eps = self.norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 < eps < 1.0:
            raise ValueError(f"norm_eps must be a number in (0, 1), got {eps!r}")

    @property
    def d_head(self) -> int:
        """Dimensions per attention head (d_k = d_v in the paper)."""
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, object]:
        """Plain data for checkpoints (`TransformerConfig.from_dict` reverses it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> TransformerConfig:
        """Build from plain data, naming any key that is not a field (a typo would otherwise vanish)."""
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(
                f"unknown TransformerConfig field(s) {unknown}; expected some of {sorted(fields)}"
            )
        return cls(**values)  # type: ignore[arg-type]


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
