"""Our Seq2SeqTransformer <-> transformers' MarianMTModel: the one mapping both directions use.

Marian is the paper's model as `transformers` has it (and as the ~1,500 OPUS-MT checkpoints are): post-LN,
sqrt(D)-scaled embeddings, sinusoidal positions, biases everywhere, no final stack norm, tied or separate
embeddings, a `final_logits_bias` (ours: `output_bias`), ReLU, GELU or SiLU ("swish", OPUS-MT's) in the
feed-forward, and the pad token as the decoder's first input (ours: `bos_id == pad_id`).

One difference is the layout of its sinusoids: ours interleave sin/cos (sin at even dimensions, cos at odd
ones), Marian puts all sines first, then all cosines, and rebuilds that table itself when it loads. A fixed
permutation of the model dimension, applied to every weight that reads or writes the residual stream
(embedding columns, LayerNorm parameters, input columns of q/k/v/fc1/lm_head, output rows of
out_proj/fc2), turns our sin/cos layout into Marian's and leaves the function unchanged: LayerNorm's mean
and variance do not depend on the order of the dimensions, and attention heads never see the residual
dimensions directly. `marian_weights` applies it (export), `weights_from_marian` undoes it (import), both
from the one table `_weight_table`; `to_marian` and `from_marian` apply them to whole models (export:
`transformer.interop.export_hf`; import: `transformer.interop.import_hf`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from transformer.config import TransformerConfig
from transformer.interop.source import ExportError
from transformer.model import Seq2SeqTransformer

if TYPE_CHECKING:
    from transformers import MarianMTModel

log = logging.getLogger(__name__)

__all__ = [
    "ACTIVATIONS",
    "MARIAN_BUFFERS",
    "config_from_marian",
    "decoding_from_marian",
    "from_marian",
    "marian_config",
    "marian_config_values",
    "marian_permutation",
    "marian_refusal",
    "marian_weights",
    "to_marian",
    "weights_from_marian",
]

# ours -> transformers' ACT2FN names (gelu = exact erf, as F.gelu; swish = silu)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "silu": "swish"}
_FROM_MARIAN_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}
# Marian keeps these as buffers of its own: sinusoid tables it rebuilds, and the logits bias
MARIAN_BUFFERS = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")

Layout = Literal["reads", "writes", "plain"]


def marian_permutation(d_model: int) -> Tensor:
    """Index (D,) long: Marian's dimension m is our dimension perm[m] (even dimensions, then odd ones)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


@dataclass(frozen=True)
class _Weight:
    """Marian's tensor `theirs` is rows `rows` of our tensor `ours` (all rows: None), laid out by `layout`:
    "reads" (out, D), columns permuted; "writes" (D, ...) or (D,), rows permuted; "plain" unchanged."""

    ours: str
    theirs: str
    layout: Layout
    rows: slice | None = None


def _weight_table(config: TransformerConfig) -> Iterator[_Weight]:
    """Every Marian weight and where it lives in ours (a tied matrix appears under each Marian name)."""
    D = config.d_model

    def attention(ours: str, theirs: str) -> Iterator[_Weight]:
        for i, name in enumerate("qkv"):  # in_proj holds [W_q; W_k; W_v], each (D, D)
            rows = slice(i * D, (i + 1) * D)
            yield _Weight(f"{ours}.in_proj_weight", f"{theirs}.{name}_proj.weight", "reads", rows)
            yield _Weight(f"{ours}.in_proj_bias", f"{theirs}.{name}_proj.bias", "plain", rows)
        yield _Weight(f"{ours}.out_proj.weight", f"{theirs}.out_proj.weight", "writes")
        yield _Weight(f"{ours}.out_proj.bias", f"{theirs}.out_proj.bias", "writes")

    def norm(ours: str, theirs: str) -> Iterator[_Weight]:
        yield _Weight(f"{ours}.weight", f"{theirs}.weight", "writes")
        yield _Weight(f"{ours}.bias", f"{theirs}.bias", "writes")

    def feed_forward(ours: str, theirs: str) -> Iterator[_Weight]:
        yield _Weight(f"{ours}.linear1.weight", f"{theirs}.fc1.weight", "reads")
        yield _Weight(f"{ours}.linear1.bias", f"{theirs}.fc1.bias", "plain")
        yield _Weight(f"{ours}.linear2.weight", f"{theirs}.fc2.weight", "writes")
        yield _Weight(f"{ours}.linear2.bias", f"{theirs}.fc2.bias", "writes")

    if config.tie_embeddings == "all":
        yield _Weight("src_embed.embedding.weight", "model.shared.weight", "reads")
    yield _Weight("src_embed.embedding.weight", "model.encoder.embed_tokens.weight", "reads")
    yield _Weight("tgt_embed.embedding.weight", "model.decoder.embed_tokens.weight", "reads")
    yield _Weight("output_projection.weight", "lm_head.weight", "reads")
    for i in range(config.n_encoder_layers):
        ours, theirs = f"encoder.layers.{i}", f"model.encoder.layers.{i}"
        yield from attention(f"{ours}.self_attn", f"{theirs}.self_attn")
        yield from norm(f"{ours}.norm1", f"{theirs}.self_attn_layer_norm")
        yield from feed_forward(f"{ours}.feed_forward", theirs)
        yield from norm(f"{ours}.norm2", f"{theirs}.final_layer_norm")
    for i in range(config.n_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"model.decoder.layers.{i}"
        yield from attention(f"{ours}.self_attn", f"{theirs}.self_attn")
        yield from norm(f"{ours}.norm1", f"{theirs}.self_attn_layer_norm")
        yield from attention(f"{ours}.cross_attn", f"{theirs}.encoder_attn")
        yield from norm(f"{ours}.norm2", f"{theirs}.encoder_attn_layer_norm")
        yield from feed_forward(f"{ours}.feed_forward", theirs)
        yield from norm(f"{ours}.norm3", f"{theirs}.final_layer_norm")


def marian_weights(config: TransformerConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Our state dict -> Marian's (every tensor a fresh contiguous copy), `final_logits_bias` included
    (zeros without `output_bias`, as Marian's own)."""
    perm = marian_permutation(config.d_model)
    weights: dict[str, Tensor] = {}
    for entry in _weight_table(config):
        tensor = state[entry.ours].detach()
        tensor = tensor if entry.rows is None else tensor[entry.rows]
        if entry.layout == "reads":
            tensor = tensor[:, perm]
        elif entry.layout == "writes":
            tensor = tensor[perm]
        weights[entry.theirs] = tensor.clone().contiguous()
    bias = state.get("output_projection.bias")
    vocab = state["output_projection.weight"].shape[0]
    weights["final_logits_bias"] = (
        bias.detach().clone().reshape(1, vocab) if bias is not None else torch.zeros(1, vocab)
    )
    return weights


def weights_from_marian(config: TransformerConfig, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Marian's state dict -> ours for `config` (from `config_from_marian`): the inverse of `marian_weights`.
    A tensor that ours holds once but Marian under several names (tied embeddings) must agree everywhere."""
    inverse = torch.argsort(marian_permutation(config.d_model))
    state: dict[str, Tensor] = {}
    for entry in _weight_table(config):
        if entry.theirs not in weights:
            raise KeyError(entry.theirs)
        tensor = weights[entry.theirs].detach()
        if entry.layout == "reads":
            tensor = tensor[:, inverse]
        elif entry.layout == "writes":
            tensor = tensor[inverse]
        if entry.rows is None:
            if entry.ours in state and not torch.equal(state[entry.ours], tensor):
                raise ValueError(f"{entry.theirs} differs from the matrix tied to it ({entry.ours} in ours)")
            state[entry.ours] = tensor.clone()
            continue
        whole = state.setdefault(
            entry.ours, tensor.new_empty((3 * config.d_model, *tensor.shape[1:]))
        )  # in_proj: q, k, v filled one after the other
        whole[entry.rows] = tensor
    if config.tie_embeddings in ("decoder", "all"):  # one matrix in ours: lm_head must be the embedding
        if not torch.equal(state.pop("output_projection.weight"), state["tgt_embed.embedding.weight"]):
            raise ValueError("lm_head.weight differs from the decoder's embedding it is tied to")
        state["output_projection.weight"] = state["tgt_embed.embedding.weight"]
    if config.tie_embeddings == "all":
        state["tgt_embed.embedding.weight"] = state["src_embed.embedding.weight"]
    if config.output_bias:
        state["output_projection.bias"] = weights["final_logits_bias"].detach().reshape(-1).clone()
    return state


def marian_config_values(config: TransformerConfig) -> dict[str, Any]:
    """The MarianConfig fields that describe `config` (the caller adds dropout and generation ids)."""
    return {
        "vocab_size": config.src_vocab_size,
        "decoder_vocab_size": config.tgt_vocab_size,
        "share_encoder_decoder_embeddings": config.tie_embeddings == "all",
        "tie_word_embeddings": config.tie_embeddings in ("all", "decoder"),
        "d_model": config.d_model,
        "encoder_layers": config.n_encoder_layers,
        "decoder_layers": config.n_decoder_layers,
        "encoder_attention_heads": config.n_heads,
        "decoder_attention_heads": config.n_heads,
        "encoder_ffn_dim": config.d_ff,
        "decoder_ffn_dim": config.d_ff,
        "activation_function": ACTIVATIONS[config.activation],
        "max_position_embeddings": config.max_len,
        "scale_embedding": config.scale_embedding,
    }


def marian_config(config: TransformerConfig) -> Any:
    """The `transformers.MarianConfig` of a model with `config`: architecture, dropout and generation ids
    (the export's, `to_marian`, and the benchmarks' transformers reference; transformers is imported
    inside the functions that build its objects only)."""
    from transformers import MarianConfig

    return MarianConfig(
        **marian_config_values(config),
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.dropout,  # ours drops the feed-forward hidden units with P_drop too
        pad_token_id=config.pad_id,
        bos_token_id=config.bos_id,
        eos_token_id=config.eos_id,
        decoder_start_token_id=config.bos_id,  # ours from BOS; an imported OPUS-MT model from pad, as Marian
        forced_eos_token_id=config.eos_id,
        architectures=["MarianMTModel"],
    )


def marian_refusal(marian: Any) -> str | None:
    """Why a transformers config cannot become ours exactly (one line naming the setting), or None."""
    model_type = getattr(marian, "model_type", None)
    if model_type != "marian":
        return (
            f"model_type={model_type!r}: only Marian (OPUS-MT) translation models can be imported "
            "(ours is post-LN with sinusoidal positions, as Marian)"
        )
    pairs = (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    )
    for encoder_key, decoder_key in pairs:
        if getattr(marian, encoder_key) != getattr(marian, decoder_key):
            return (
                f"{encoder_key}={getattr(marian, encoder_key)} but {decoder_key}="
                f"{getattr(marian, decoder_key)}: ours has one value for both stacks"
            )
    if marian.activation_function not in _FROM_MARIAN_ACTIVATIONS:
        return f"activation_function={marian.activation_function!r}: ours has relu, gelu and swish (silu)"
    if getattr(marian, "static_position_embeddings", False):
        return "static_position_embeddings=true: not a Marian setting ours knows"
    vocab, decoder_vocab = marian.vocab_size, marian.decoder_vocab_size or marian.vocab_size
    if marian.share_encoder_decoder_embeddings and vocab != decoder_vocab:
        return (
            f"share_encoder_decoder_embeddings=true with vocab_size {vocab} != decoder_vocab_size "
            f"{decoder_vocab}"
        )
    if marian.share_encoder_decoder_embeddings and not getattr(marian, "tie_word_embeddings", True):
        return (
            "share_encoder_decoder_embeddings=true with tie_word_embeddings=false: ours ties the output "
            "projection to a shared embedding"
        )
    if marian.decoder_start_token_id not in (marian.pad_token_id, marian.bos_token_id):
        return (
            f"decoder_start_token_id={marian.decoder_start_token_id} is neither the pad nor the BOS token: "
            "ours starts the decoder from one of them"
        )
    if marian.eos_token_id in (marian.pad_token_id, marian.decoder_start_token_id):
        return "eos_token_id equals the pad or decoder start token: ours needs a distinct end token"
    return None


def config_from_marian(marian: Any) -> TransformerConfig:
    """Our config for a MarianConfig `marian_refusal` accepts; the decoder starts from its start token.

    `tie_word_embeddings` decides whether lm_head is the decoder's embedding ("decoder" or "all") or a
    matrix of its own ("none", possible only with separate source and target embeddings in ours)."""
    decoder_vocab = marian.decoder_vocab_size or marian.vocab_size
    shared = marian.share_encoder_decoder_embeddings
    tied = bool(getattr(marian, "tie_word_embeddings", True))
    return TransformerConfig(
        src_vocab_size=marian.vocab_size,
        tgt_vocab_size=decoder_vocab,
        d_model=marian.d_model,
        n_heads=marian.encoder_attention_heads,
        n_encoder_layers=marian.encoder_layers,
        n_decoder_layers=marian.decoder_layers,
        d_ff=marian.encoder_ffn_dim,
        dropout=float(marian.dropout),
        attention_dropout=float(marian.attention_dropout),
        activation=_FROM_MARIAN_ACTIVATIONS[marian.activation_function],  # type: ignore[arg-type]
        norm_first=False,
        scale_embedding=bool(marian.scale_embedding),
        positional="sinusoidal",
        max_len=marian.max_position_embeddings,
        tie_embeddings=("all" if shared else "decoder") if tied else "none",
        output_bias=True,
        pad_id=marian.pad_token_id,
        bos_id=marian.decoder_start_token_id,
        eos_id=marian.eos_token_id,
    )


# An imported model's decoding: its generation settings as `generate` reads them (generation_config.json over
# the generation keys an older config.json holds), transformers' defaults where neither names one, except
# the beam size: 4 where neither names one (OPUS-MT's).
_GENERATION_DEFAULTS = {"num_beams": 4, "length_penalty": 1.0, "early_stopping": False}


def decoding_from_marian(directory: Path) -> dict[str, Any]:
    """The decoding settings (`DecodingSettings` fields) that decode an imported Marian model as its own
    generation settings do: beam size `num_beams`, transformers' length normalization (summed
    log-probability / len ** `length_penalty`, len = the generated tokens with EOS: "power"), and the
    limit 1.2 * source length + 10.

    `early_stopping`: False (transformers' default) is our beam search's own stopping rule, and so is
    "never" with alpha <= 0 (transformers then bounds a live beam at its current length too). True (stop
    once num_beams hypotheses have ended, even if a live beam could still beat them) and "never" with
    alpha > 0 (bound a live beam at the maximum length) have no counterpart here: the import keeps our rule
    and logs a warning saying so. A value of the wrong kind raises ValueError naming its file and key."""
    values: dict[str, tuple[Any, str]] = {}
    for name in ("config.json", "generation_config.json"):  # the second wins, as in transformers
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as unreadable:
            raise ValueError(f"{path} cannot be read as JSON ({unreadable})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a JSON object")
        values.update({key: (data[key], name) for key in _GENERATION_DEFAULTS if data.get(key) is not None})
    beams, beams_from = values.get("num_beams", (_GENERATION_DEFAULTS["num_beams"], ""))
    alpha, alpha_from = values.get("length_penalty", (_GENERATION_DEFAULTS["length_penalty"], ""))
    stopping, stopping_from = values.get("early_stopping", (_GENERATION_DEFAULTS["early_stopping"], ""))
    if isinstance(beams, bool) or not isinstance(beams, int) or beams < 1:
        raise ValueError(f"{directory / beams_from}: num_beams must be an integer >= 1, got {beams!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{directory / alpha_from}: length_penalty must be a finite number, got {alpha!r}")
    if stopping not in (True, False, "never"):
        raise ValueError(
            f'{directory / stopping_from}: early_stopping must be true, false or "never", got {stopping!r}'
        )
    if beams > 1 and (stopping is True or (stopping == "never" and alpha > 0)):
        log.warning(
            "%s: early_stopping=%r has no counterpart in our beam search; the import decodes with "
            "transformers' early_stopping=false rule (stop once num_beams hypotheses have ended and the best "
            "live beam, normalized at its current length, cannot beat them), which may return other "
            "translations than generate() with this setting",
            directory / stopping_from,
            stopping,
        )
    return {
        "beam_size": beams,
        "length_penalty": float(alpha),
        "length_normalization": "power",
        "max_len_a": 1.2,
        "max_len_b": 10,
    }


def _marian_state_dict(model: Seq2SeqTransformer) -> dict[str, Tensor]:
    """Our weights under Marian's names, the model dimension permuted (`marian_weights`)."""
    return marian_weights(model.config, model.state_dict())


def to_marian(model: Seq2SeqTransformer) -> MarianMTModel:
    """A `MarianMTModel` (eval mode) computing exactly what `model` computes (post-LN, sinusoidal)."""
    from transformers import MarianMTModel

    marian = MarianMTModel(marian_config(model.config)).eval()
    weights = _marian_state_dict(model)
    missing, unexpected = marian.load_state_dict(weights, strict=False)
    if set(missing) - set(MARIAN_BUFFERS) or unexpected:  # Marian rebuilds its sinusoid tables itself
        raise RuntimeError(f"Marian weights do not line up: missing {missing}, unexpected {unexpected}")
    return marian


def from_marian(marian: MarianMTModel, name: str = "this model") -> Seq2SeqTransformer:
    """Ours (eval mode) computing exactly what `marian` computes: an OPUS-MT model's weights in our
    model, its decoder starting from the pad token (`bos_id == pad_id`). A config ours cannot represent
    is refused with an `ExportError` naming the setting (`marian_refusal`) and `name` (the directory
    imported)."""
    refusal = marian_refusal(marian.config)
    if refusal is not None:
        raise ExportError(f"cannot import {name}: {refusal}")
    try:
        config = config_from_marian(marian.config)
    except ValueError as bad:  # a value our TransformerConfig refuses (max_position_embeddings 1)
        raise ExportError(f"cannot import {name}: its config gives {bad}") from None
    model = Seq2SeqTransformer(config).eval()
    try:
        state = weights_from_marian(config, marian.state_dict())
    except KeyError as missing:
        raise ExportError(f"cannot import {name}: it has no weight {missing}") from None
    except ValueError as untied:
        raise ExportError(f"cannot import {name}: {untied}") from None
    model.load_state_dict(state, strict=True)
    return model
