"""BERT-family classifiers (transformers' BertForSequenceClassification / BertModel, DistilBERT's) -> our
`TransformerClassifier`: the config and weight mapping (a whole directory as a checkpoint:
`transformer.interop.import_bert`).

BERT's encoder is our encoder-only model with options a from-scratch config may use too: learned absolute
positions (`positional: learned`), unscaled token embeddings (`scale_embedding: false`), a LayerNorm on the
embeddings (`embedding_norm: true`), post-LN layers, the erf GELU (`activation: gelu`, as transformers'
"gelu"), LayerNorm epsilon 1e-12 (`norm_eps`), and the [CLS] pooler: dense + tanh before the head
(`pooling: cls_tanh`; DistilBERT's pre-classifier is dense + ReLU, `cls_relu`). Its query, key and value
projections are the rows of our `in_proj`.

The token-type embedding: our classifier reads single-segment input, whose token types are all 0, so
BERT adds the same vector `token_type_embeddings[0]` at every position. It is folded into the position
table (every row of ours = BERT's position row + that vector), which is exact up to the order of two float
additions; a second segment (sentence pairs) is not representable and not needed here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from transformer.config import TransformerConfig

__all__ = [
    "BERT_MODEL_TYPES",
    "HEADED_CLASSES",
    "POOLING",
    "bert_refusal",
    "config_from_bert",
    "weights_from_bert",
]

BERT_MODEL_TYPES = ("bert", "distilbert")
_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu"}  # transformers' -> ours
POOLING = {"bert": "cls_tanh", "distilbert": "cls_relu"}
HEADED_CLASSES = {  # the transformers class of each model_type with a classification head
    "bert": "BertForSequenceClassification",
    "distilbert": "DistilBertForSequenceClassification",
}
_DISTILBERT_NORM_EPS = 1e-12  # DistilBERT's LayerNorms: fixed in its code, not in its config


@dataclasses.dataclass(frozen=True)
class _Shape:
    """A BERT-family config's numbers under one set of names (BERT's and DistilBERT's differ)."""

    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    activation: str
    dropout: float
    attention_dropout: float
    norm_eps: float


def _shape(config: Any) -> _Shape:
    if config.model_type == "distilbert":
        return _Shape(
            config.dim, config.n_heads, config.n_layers, config.hidden_dim, config.activation,
            config.dropout, config.attention_dropout, _DISTILBERT_NORM_EPS,
        )  # fmt: skip
    return _Shape(
        config.hidden_size, config.num_attention_heads, config.num_hidden_layers, config.intermediate_size,
        config.hidden_act, config.hidden_dropout_prob, config.attention_probs_dropout_prob,
        config.layer_norm_eps,
    )  # fmt: skip


def bert_refusal(config: Any) -> str | None:
    """Why a BERT-family transformers config cannot become our classifier exactly (one line naming the
    setting), or None."""
    model_type = getattr(config, "model_type", None)
    if model_type not in BERT_MODEL_TYPES:
        return f"model_type={model_type!r} is not a BERT-family encoder ({', '.join(BERT_MODEL_TYPES)})"
    position = getattr(config, "position_embedding_type", "absolute")
    if position != "absolute":
        return f"position_embedding_type={position!r}: ours has absolute (learned) positions only"
    for flag in ("is_decoder", "add_cross_attention"):
        if getattr(config, flag, False):
            return f"{flag}=true: ours is a bidirectional encoder without cross-attention"
    if getattr(config, "pruned_heads", None):
        return "pruned_heads: ours has the same number of heads in every layer"
    shape = _shape(config)
    if not isinstance(shape.activation, str) or shape.activation not in _ACTIVATIONS:
        name = "activation" if model_type == "distilbert" else "hidden_act"
        return f"{name}={shape.activation!r}: ours has gelu (erf, transformers' 'gelu'), relu and silu"
    problem = getattr(config, "problem_type", None)
    if problem not in (None, "single_label_classification"):
        return f"problem_type={problem!r}: ours classifies each text into one class"
    return None


def config_from_bert(config: Any, *, pad_id: int, bos_id: int, eos_id: int) -> TransformerConfig:
    """Our encoder-only config for a config `bert_refusal` accepts; the special ids are its tokenizer's
    ([PAD], [CLS] as BOS, [SEP] as EOS: transformers' BERT configs do not name [CLS] and [SEP])."""
    shape = _shape(config)
    return TransformerConfig(
        src_vocab_size=config.vocab_size,
        d_model=shape.d_model,
        n_heads=shape.n_heads,
        n_encoder_layers=shape.n_layers,
        n_decoder_layers=0,
        d_ff=shape.d_ff,
        dropout=float(shape.dropout),
        attention_dropout=float(shape.attention_dropout),
        activation=_ACTIVATIONS[shape.activation],  # type: ignore[arg-type]
        norm_first=False,
        positional="learned",
        max_len=config.max_position_embeddings,
        scale_embedding=False,
        embedding_norm=True,
        norm_eps=float(shape.norm_eps),
        pad_id=pad_id,
        bos_id=bos_id,
        eos_id=eos_id,
    )


def _weight_table(model_type: str, n_layers: int) -> Iterator[tuple[str, str | tuple[str, str, str]]]:
    """(ours, theirs) for every weight but the positions and the head: `theirs` is relative to the base
    model (`bert.` / `distilbert.`), or the (query, key, value) triple stacked into our `in_proj`."""
    yield "src_embed.embedding.weight", "embeddings.word_embeddings.weight"
    for part in ("weight", "bias"):
        yield f"src_embed.norm.{part}", f"embeddings.LayerNorm.{part}"
    for i in range(n_layers):
        ours = f"encoder.layers.{i}"
        if model_type == "distilbert":
            theirs = f"transformer.layer.{i}"
            qkv = tuple(f"{theirs}.attention.{n}_lin" for n in "qkv")
            names = {
                "self_attn.out_proj": f"{theirs}.attention.out_lin",
                "norm1": f"{theirs}.sa_layer_norm",
                "feed_forward.linear1": f"{theirs}.ffn.lin1",
                "feed_forward.linear2": f"{theirs}.ffn.lin2",
                "norm2": f"{theirs}.output_layer_norm",
            }
        else:
            theirs = f"encoder.layer.{i}"
            qkv = tuple(f"{theirs}.attention.self.{n}" for n in ("query", "key", "value"))
            names = {
                "self_attn.out_proj": f"{theirs}.attention.output.dense",
                "norm1": f"{theirs}.attention.output.LayerNorm",
                "feed_forward.linear1": f"{theirs}.intermediate.dense",
                "feed_forward.linear2": f"{theirs}.output.dense",
                "norm2": f"{theirs}.output.LayerNorm",
            }
        yield f"{ours}.self_attn.in_proj_weight", tuple(f"{name}.weight" for name in qkv)  # type: ignore[misc]
        yield f"{ours}.self_attn.in_proj_bias", tuple(f"{name}.bias" for name in qkv)  # type: ignore[misc]
        for our_name, their_name in names.items():
            for part in ("weight", "bias"):
                yield f"{ours}.{our_name}.{part}", f"{their_name}.{part}"


def weights_from_bert(
    model_type: str, config: TransformerConfig, weights: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """A BertForSequenceClassification's (or DistilBERT's) state dict -> our classifier's, for `config`
    from `config_from_bert`. A missing weight raises KeyError naming it."""
    base = f"{model_type}."

    def get(name: str) -> Tensor:
        if name not in weights:
            raise KeyError(name)
        return weights[name].detach()

    state: dict[str, Tensor] = {}
    for ours, theirs in _weight_table(model_type, config.n_encoder_layers):
        if isinstance(theirs, tuple):  # in_proj = [W_q; W_k; W_v] (3D, D), its bias likewise
            state[ours] = torch.cat([get(base + name) for name in theirs]).clone()
        else:
            state[ours] = get(base + theirs).clone()
    positions = get(f"{base}embeddings.position_embeddings.weight").clone()  # (max_len, D)
    if model_type == "bert":  # single-segment input: token type 0 everywhere, folded in (module docstring)
        positions += get(f"{base}embeddings.token_type_embeddings.weight")[0]
    state["src_embed.positional.embedding.weight"] = positions
    pooler = "bert.pooler.dense" if model_type == "bert" else "pre_classifier"
    for part in ("weight", "bias"):
        state[f"pooler.0.{part}"] = get(f"{pooler}.{part}").clone()
        state[f"head.{part}"] = get(f"classifier.{part}").clone()
    return state
