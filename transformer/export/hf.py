"""Checkpoint -> a Hugging Face `transformers` directory: MarianMTModel, fast tokenizer, generation config.

Marian is the paper's model as `transformers` has it: post-LN, sqrt(D)-scaled embeddings, sinusoidal
positions, biases everywhere, no final stack norm, tied or separate embeddings. One difference is the
layout of its sinusoids: ours interleave sin/cos (sin at even dimensions, cos at odd ones), Marian puts
all sines first, then all cosines, and rebuilds that table itself when it loads. A fixed permutation of
the model dimension, applied to every weight that reads or writes the residual stream (embedding
columns, LayerNorm parameters, input columns of q/k/v/fc1/lm_head, output rows of out_proj/fc2),
turns our sin/cos layout into Marian's and leaves the function unchanged: LayerNorm's mean and
variance do not depend on the order of the dimensions, and attention heads never see the residual
dimensions directly. Every export is compared with the checkpoint once written
(`transformer.export.check`); `tests/unit/test_export.py` checks logits and greedy search against ours.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
import torch
from torch import Tensor, nn
from transformers import GenerationConfig, MarianConfig, MarianMTModel, PreTrainedTokenizerFast

from transformer.disk import human_size, tensor_bytes
from transformer.export.card import write_model_card
from transformer.export.check import TOLERANCE, Exported, probe_batch, reference_log_probs
from transformer.export.source import ExportError, ExportSource, staged_output
from transformer.layers import FeedForward
from transformer.model import Seq2SeqTransformer

__all__ = ["export_hf", "hf_refusal", "marian_permutation", "to_marian"]

_ACTIVATIONS = {"relu": "relu", "gelu": "gelu"}  # transformers' ACT2FN names (gelu = exact erf, as F.gelu)


def hf_refusal(source: ExportSource) -> str | None:
    """Why `source` cannot become a Marian model exactly (one line naming the setting), or None."""
    config = source.config
    if config.norm_first:
        return "model.config.norm_first=true (pre-LN): transformers' Marian is post-LN only"
    if config.positional != "sinusoidal":
        return f"model.config.positional={config.positional}: transformers' Marian has sinusoids only"
    if config.activation not in _ACTIVATIONS:
        return f"model.config.activation={config.activation}: transformers' Marian has no gated feed-forward"
    if not source.joint_vocabulary:
        return (
            "separate source and target tokenizers: a transformers translation pipeline encodes and decodes "
            "with one tokenizer (train with a joint vocabulary, or export with --to ctranslate2)"
        )
    return None


def marian_permutation(d_model: int) -> Tensor:
    """Index (D,) long: Marian's dimension m is our dimension perm[m] (even dimensions, then odd ones)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _marian_config(model: Seq2SeqTransformer) -> MarianConfig:
    config = model.config
    share = config.tie_embeddings == "all"
    return MarianConfig(
        vocab_size=config.src_vocab_size,
        decoder_vocab_size=config.tgt_vocab_size,
        share_encoder_decoder_embeddings=share,
        tie_word_embeddings=config.tie_embeddings in ("all", "decoder"),
        d_model=config.d_model,
        encoder_layers=config.n_encoder_layers,
        decoder_layers=config.n_decoder_layers,
        encoder_attention_heads=config.n_heads,
        decoder_attention_heads=config.n_heads,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        activation_function=_ACTIVATIONS[config.activation],
        max_position_embeddings=config.max_len,
        scale_embedding=True,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.dropout,  # ours drops the feed-forward hidden units with P_drop too
        pad_token_id=config.pad_id,
        bos_token_id=config.bos_id,
        eos_token_id=config.eos_id,
        decoder_start_token_id=config.bos_id,  # ours starts from BOS (Marian's own models from pad)
        forced_eos_token_id=config.eos_id,
        architectures=["MarianMTModel"],
    )


def _marian_state_dict(model: Seq2SeqTransformer) -> dict[str, Tensor]:
    """Our weights under Marian's names, the model dimension permuted (see the module docstring)."""
    config = model.config
    perm = marian_permutation(config.d_model)
    D = config.d_model
    weights: dict[str, Tensor] = {}

    def reads(weight: Tensor) -> Tensor:  # (out, D): a layer reading the residual stream
        return weight[:, perm]

    def writes(tensor: Tensor) -> Tensor:  # (D, in) or (D,): a layer writing it, or a LayerNorm
        return tensor[perm]

    def attention(prefix: str, module: nn.Module) -> None:
        for i, name in enumerate("qkv"):  # in_proj holds [W_q; W_k; W_v], each (D, D)
            weights[f"{prefix}.{name}_proj.weight"] = reads(module.in_proj_weight[i * D : (i + 1) * D])
            weights[f"{prefix}.{name}_proj.bias"] = module.in_proj_bias[i * D : (i + 1) * D]
        weights[f"{prefix}.out_proj.weight"] = writes(module.out_proj.weight)
        weights[f"{prefix}.out_proj.bias"] = writes(module.out_proj.bias)

    def norm(prefix: str, module: nn.LayerNorm) -> None:
        weights[f"{prefix}.weight"], weights[f"{prefix}.bias"] = writes(module.weight), writes(module.bias)

    def feed_forward(prefix: str, module: FeedForward) -> None:
        weights[f"{prefix}.fc1.weight"] = reads(module.linear1.weight)
        weights[f"{prefix}.fc1.bias"] = module.linear1.bias
        weights[f"{prefix}.fc2.weight"] = writes(module.linear2.weight)
        weights[f"{prefix}.fc2.bias"] = writes(module.linear2.bias)

    src_embedding = reads(model.src_embed.embedding.weight)  # (V, D): one row per token
    tgt_embedding = reads(model.tgt_embed.embedding.weight)
    if config.tie_embeddings == "all":
        weights["model.shared.weight"] = src_embedding
    weights["model.encoder.embed_tokens.weight"] = src_embedding
    weights["model.decoder.embed_tokens.weight"] = tgt_embedding
    weights["lm_head.weight"] = reads(model.output_projection.weight)
    for i, layer in enumerate(model.encoder.layers):
        prefix = f"model.encoder.layers.{i}"
        attention(f"{prefix}.self_attn", layer.self_attn)
        norm(f"{prefix}.self_attn_layer_norm", layer.norm1)
        feed_forward(prefix, layer.feed_forward)
        norm(f"{prefix}.final_layer_norm", layer.norm2)
    for i, layer in enumerate(model.decoder.layers):
        prefix = f"model.decoder.layers.{i}"
        attention(f"{prefix}.self_attn", layer.self_attn)
        norm(f"{prefix}.self_attn_layer_norm", layer.norm1)
        attention(f"{prefix}.encoder_attn", layer.cross_attn)
        norm(f"{prefix}.encoder_attn_layer_norm", layer.norm2)
        feed_forward(prefix, layer.feed_forward)
        norm(f"{prefix}.final_layer_norm", layer.norm3)
    return {name: tensor.detach().clone().contiguous() for name, tensor in weights.items()}


def to_marian(model: Seq2SeqTransformer) -> MarianMTModel:
    """A `MarianMTModel` (eval mode) computing exactly what `model` computes (post-LN, sinusoidal)."""
    marian = MarianMTModel(_marian_config(model)).eval()
    weights = _marian_state_dict(model)
    missing, unexpected = marian.load_state_dict(weights, strict=False)
    # Marian keeps its sinusoid tables and a zero logits bias as buffers of its own
    expected_missing = {
        "final_logits_bias",
        "model.encoder.embed_positions.weight",
        "model.decoder.embed_positions.weight",
    }
    if set(missing) - expected_missing or unexpected:
        raise RuntimeError(f"Marian weights do not line up: missing {missing}, unexpected {unexpected}")
    return marian


def generation_config(source: ExportSource) -> GenerationConfig:
    """The checkpoint's test-time decoding as `transformers` generation settings.

    Not expressible there, and so only approximated (README "Export and deploy"): the per-sentence length
    limit floor(max_len_a * source length + max_len_b) (a global max_length = the model's max_len is
    used), and the length penalty's formula (ours GNMT's ((5 + len) / 6) ** alpha, transformers'
    len ** alpha; the same alpha is written).
    """
    config, decoding = source.config, source.decoding
    beam = decoding.get("search") != "greedy" and int(decoding.get("beam_size", 1)) > 1
    settings: dict[str, Any] = {
        "decoder_start_token_id": config.bos_id,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
        "forced_eos_token_id": config.eos_id,
        "suppress_tokens": [config.pad_id, config.bos_id],  # ours never emits them either
        "max_length": config.max_len + 1,  # the start token + at most max_len tokens, as ours caps it
        "num_beams": int(decoding.get("beam_size", 1)) if beam else 1,
        "do_sample": False,
    }
    if beam:
        settings.update(length_penalty=float(decoding.get("length_penalty", 1.0)), early_stopping=False)
    return GenerationConfig(**settings)


def fast_tokenizer(source: ExportSource) -> PreTrainedTokenizerFast:
    """Our `tokenizers` BPE as a transformers fast tokenizer: <s> ... </s> on encoding (its own post-
    processor), detokenization by its own decoder, and no "clean-up" of spaces (ours does none)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(source.src_tokenizer_json),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=source.config.max_len,
    )


def _portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class by the name both transformers 4 and 5 know: version 5 writes its new
    `TokenizersBackend`, which version 4's AutoTokenizer cannot resolve; `PreTrainedTokenizerFast` is the
    same class in version 5 (an alias) and the fast tokenizer in version 4."""
    settings = json.loads(path.read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export_hf(source: ExportSource, output: str | Path, *, force: bool = False) -> Exported:
    """Write `source` as a transformers directory at `output` (see the module docstring), checked
    against the checkpoint once written (`transformer.export.check`)."""
    refusal = hf_refusal(source)
    if refusal is not None:
        raise ExportError(f"cannot export {source.path} to transformers: {refusal}")
    marian = to_marian(source.model)
    marian.generation_config = generation_config(source)
    tokenizer = fast_tokenizer(source)
    size = human_size(tensor_bytes(marian.state_dict()))
    with staged_output(output, force=force, what=f"the transformers export of {size}") as staging:
        marian.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        _portable_tokenizer_class(staging / "tokenizer_config.json")
        write_model_card(source, staging / "README.md", target="hf")
        difference = _check(source, staging)
    return Exported(Path(output), difference, "log-probabilities of the files loaded back, on a probe batch")


def _check(source: ExportSource, directory: Path) -> float:
    """Max |log p| difference between the saved directory (loaded back) and the checkpoint, at every
    real target position and vocabulary entry of `probe_batch`; above TOLERANCE the export fails."""
    src, tgt = probe_batch(source.config)
    ours = reference_log_probs(source.model, src, tgt)  # (B, T - 1, V)
    marian = MarianMTModel.from_pretrained(directory).eval()
    pad = source.config.pad_id
    with torch.no_grad():
        logits = marian(input_ids=src, attention_mask=src.ne(pad), decoder_input_ids=tgt[:, :-1]).logits
    real = tgt[:, 1:].ne(pad)  # (B, T - 1): positions that predict a real token
    difference = (logits.float().log_softmax(-1) - ours)[real].abs().max().item()
    if not difference <= TOLERANCE:
        raise ExportError(
            f"the exported model's log-probabilities differ from {source.path}'s by {difference:.2e} "
            f"(more than {TOLERANCE}) on a probe batch: nothing written"
        )
    return difference
