"""Checkpoint -> a CTranslate2 model directory, built with CTranslate2's own spec API (`ctranslate2.specs`).

Our weights go into a `TransformerSpec` as they are: CTranslate2 takes the position table explicitly
(so our sin/cos layout, or learned positions, need no permutation), has rotary self-attention in our
"rotate half" layout, fuses q/k/v the way our `in_proj_weight` already stores them, and has both post-LN
and pre-LN (with a final norm per stack) layouts, ReLU, GELU and gated (SwiGLU) feed-forwards: every
setting of `TransformerConfig` maps exactly (tests/unit/test_export.py checks each). The config adds
`<s>` and `</s>` to the source and starts the decoder from `<s>`, so users pass plain subword tokens,
as with CTranslate2's own converters; the tokenizer JSON(s) are written beside the model. An imported
OPUS-MT model (aiayn-import) keeps Marian's conventions: sources end with `</s>` and have no `<s>`, the
decoder starts from `<pad>` (its own embedding: no `start_from_zero_embedding`, which CTranslate2's Marian
converter assumes and a fine-tuned pad row breaks), and its SentencePiece models are written beside the
model, to tokenize outside CTranslate2 (tests/unit/test_export_imported.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import ctranslate2
import numpy as np
import torch
from ctranslate2.specs import common_spec, transformer_spec
from torch import Tensor, nn

from transformer.interop.card import write_model_card
from transformer.interop.check import TOLERANCE, Exported, probe_batch, reference_log_probs
from transformer.interop.source import ExportError, ExportSource, staged_output
from transformer.layers import FeedForward
from transformer.model import Seq2SeqTransformer

__all__ = [
    "QUANTIZATIONS",
    "export_ctranslate2",
    "to_ctranslate2_spec",
    "tokenizer_files",
]

# CTranslate2's weight types (`ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES`); None keeps float32
QUANTIZATIONS = (
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "int16",
    "float16",
    "bfloat16",
    "float32",
)
_ACTIVATIONS = {
    "relu": common_spec.Activation.RELU,
    "gelu": common_spec.Activation.GELU,  # the exact (erf) GELU, as F.gelu
    "silu": common_spec.Activation.SWISH,  # OPUS-MT's feed-forward
    "swiglu": common_spec.Activation.SWISH,  # silu(x W1) * (x W3): CTranslate2's ffn_glu
}


def _array(tensor: Tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy().copy()


def _set_linear(spec: common_spec.LinearSpec, weight: Tensor, bias: Tensor | None) -> None:
    spec.weight = _array(weight)
    if bias is not None:
        spec.bias = _array(bias)


def _set_norm(spec: common_spec.LayerNormSpec, norm: nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def _set_self_attention(
    spec: transformer_spec.attention_spec.MultiHeadAttentionSpec, module: nn.Module
) -> None:
    _set_linear(spec.linear[0], module.in_proj_weight, module.in_proj_bias)  # (3D, D): [W_q; W_k; W_v]
    _set_linear(spec.linear[1], module.out_proj.weight, module.out_proj.bias)


def _set_cross_attention(
    spec: transformer_spec.attention_spec.MultiHeadAttentionSpec, module: nn.Module
) -> None:
    D = module.embed_dim
    weight, bias = module.in_proj_weight, module.in_proj_bias
    _set_linear(spec.linear[0], weight[:D], None if bias is None else bias[:D])  # queries from the decoder
    _set_linear(spec.linear[1], weight[D:], None if bias is None else bias[D:])  # keys and values (2D, D)
    _set_linear(spec.linear[2], module.out_proj.weight, module.out_proj.bias)


def _set_feed_forward(spec: transformer_spec.FeedForwardSpec, module: FeedForward) -> None:
    _set_linear(spec.linear_0, module.linear1.weight, module.linear1.bias)
    if module.gate is not None:
        _set_linear(spec.linear_0_noact, module.gate.weight, module.gate.bias)
    _set_linear(spec.linear_1, module.linear2.weight, module.linear2.bias)


def _positions(embedder: nn.Module) -> np.ndarray:
    """The (max_len, D) table of absolute positions the embedder adds (sinusoidal or learned)."""
    positional = embedder.positional
    table = positional.table if hasattr(positional, "table") else positional.embedding.weight
    return _array(table)


def to_ctranslate2_spec(source: ExportSource) -> transformer_spec.TransformerSpec:
    """A validated `TransformerSpec` holding `source`'s weights and vocabularies (not yet quantized)."""
    model: Seq2SeqTransformer = source.model
    config = model.config
    common = {
        "pre_norm": config.norm_first,  # pre-LN: a final norm per stack, as ours
        "activation": _ACTIVATIONS[config.activation],
        "ffn_glu": config.activation == "swiglu",
        "layernorm_embedding": config.embedding_norm,  # on token + position embeddings, as ours
    }
    if config.positional == "rope":  # self-attention only (as ours), pairs (j, j + Dh/2): not interleaved
        common.update(rotary_dim=0, rotary_interleave=False)
    encoder = transformer_spec.TransformerEncoderSpec(config.n_encoder_layers, config.n_heads, **common)
    decoder = transformer_spec.TransformerDecoderSpec(config.n_decoder_layers, config.n_heads, **common)
    spec = transformer_spec.TransformerSpec(encoder, decoder)

    encoder.scale_embeddings = decoder.scale_embeddings = config.scale_embedding
    if config.embedding_norm:
        _set_norm(encoder.layernorm_embedding, model.src_embed.norm)
        _set_norm(decoder.layernorm_embedding, model.tgt_embed.norm)
    encoder.embeddings[0].weight = _array(model.src_embed.embedding.weight)
    if config.positional != "rope":
        encoder.position_encodings.encodings = _positions(model.src_embed)
    for layer_spec, layer in zip(encoder.layer, model.encoder.layers):
        _set_self_attention(layer_spec.self_attention, layer.self_attn)
        _set_norm(layer_spec.self_attention.layer_norm, layer.norm1)
        _set_feed_forward(layer_spec.ffn, layer.feed_forward)
        _set_norm(layer_spec.ffn.layer_norm, layer.norm2)
    decoder.embeddings.weight = _array(model.tgt_embed.embedding.weight)
    if config.positional != "rope":
        decoder.position_encodings.encodings = _positions(model.tgt_embed)
    _set_linear(decoder.projection, model.output_projection.weight, model.output_projection.bias)
    for layer_spec, layer in zip(decoder.layer, model.decoder.layers):
        _set_self_attention(layer_spec.self_attention, layer.self_attn)
        _set_norm(layer_spec.self_attention.layer_norm, layer.norm1)
        _set_cross_attention(layer_spec.attention, layer.cross_attn)
        _set_norm(layer_spec.attention.layer_norm, layer.norm2)
        _set_feed_forward(layer_spec.ffn, layer.feed_forward)
        _set_norm(layer_spec.ffn.layer_norm, layer.norm3)
    if config.norm_first:
        _set_norm(encoder.layer_norm, model.encoder.norm)
        _set_norm(decoder.layer_norm, model.decoder.norm)

    spec.register_source_vocabulary(source.vocabulary("src"))
    spec.register_target_vocabulary(source.vocabulary("tgt"))
    tgt_vocabulary = source.vocabulary("tgt")
    spec.config.unk_token = "<unk>"
    spec.config.bos_token = tgt_vocabulary[config.bos_id]
    spec.config.eos_token = tgt_vocabulary[config.eos_id]
    spec.config.decoder_start_token = tgt_vocabulary[config.bos_id]
    # our sources are <s> ... </s>; Marian's (bos_id == pad_id: the decoder starts from <pad>) ... </s>
    spec.config.add_source_bos = config.bos_id != config.pad_id
    spec.config.add_source_eos = True
    spec.config.layer_norm_epsilon = config.norm_eps  # every LayerNorm of ours uses it
    spec.validate()
    return spec


def tokenizer_files(source: ExportSource) -> dict[str, str]:
    """File names of the tokenizer(s) written beside the model: one `tokenizer.json` for a joint
    vocabulary, else `source_tokenizer.json` and `target_tokenizer.json`; an imported model's
    SentencePiece models `source.spm` and `target.spm`."""
    if source.sentencepiece is not None:
        return {"src": "source.spm", "tgt": "target.spm"}
    if source.joint_vocabulary:
        return {"src": "tokenizer.json", "tgt": "tokenizer.json"}
    return {"src": "source_tokenizer.json", "tgt": "target_tokenizer.json"}


def export_ctranslate2(
    source: ExportSource, output: str | Path, *, quantization: str | None = None, force: bool = False
) -> Exported:
    """Write `source` as a CTranslate2 model directory at `output`, weights quantized as asked, checked
    against the checkpoint once written (`transformer.interop.check`; required to match in float32)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ExportError(f"--quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    spec = to_ctranslate2_spec(source)
    spec.optimize(quantization=quantization)
    files = tokenizer_files(source)
    what = f"the CTranslate2 export ({quantization or 'float32'} weights)"
    with staged_output(output, force=force, what=what) as staging:
        spec.save(str(staging))
        if source.sentencepiece is not None:
            (staging / files["src"]).write_bytes(source.sentencepiece.source_model)
            (staging / files["tgt"]).write_bytes(source.sentencepiece.target_model)
        else:
            (staging / files["src"]).write_text(source.src_tokenizer_json, encoding="utf-8")
            (staging / files["tgt"]).write_text(source.tgt_tokenizer_json, encoding="utf-8")
        write_model_card(source, staging / "README.md", target="ctranslate2", tokenizer_files=files)
        exact = quantization in (None, "float32")
        difference = _check(source, staging, enforce=exact)
    checked = "target log-probabilities of the files loaded back, on a probe batch"
    if not exact:
        checked += f" (not required to match: {quantization} weights change the numbers)"
    return Exported(Path(output), difference, checked)


@contextlib.contextmanager
def keeping_torch_threads() -> Iterator[None]:
    """Starting a `ctranslate2.Translator` sets the OpenMP thread count to its `intra_threads`, and in a
    process that has loaded torch the two share one OpenMP runtime: torch's intra-op thread count changed
    with it (2 -> 1 for `intra_threads=1`), and our beam search then ran 7-8x slower on the 2-core CPU
    (benchmarks/decode/bench_student.py's "ours" column, 2026-11-27). Whatever starts a Translator inside this
    block, torch's count is what it was afterwards."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _check(source: ExportSource, directory: Path, *, enforce: bool) -> float:
    """Max |log p| difference between the saved model (loaded back by `ctranslate2.Translator`) and the
    checkpoint, over the target tokens of `probe_batch`; with `enforce`, above TOLERANCE fails."""
    config = source.config
    src, tgt = probe_batch(config)
    ours = reference_log_probs(source.model, src, tgt)  # (B, T - 1, V)
    ours = ours.gather(-1, tgt[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T - 1): of each next token, then EOS
    src_vocabulary, tgt_vocabulary = source.vocabulary("src"), source.vocabulary("tgt")

    def plain(row: Tensor, vocabulary: list[str]) -> list[str]:  # without <s>, </s> and padding
        return [vocabulary[i] for i in row.tolist() if i not in (config.pad_id, config.bos_id, config.eos_id)]

    with keeping_torch_threads():
        translator = ctranslate2.Translator(str(directory), device="cpu")
    scores = translator.score_batch(
        [plain(row, src_vocabulary) for row in src], [plain(row, tgt_vocabulary) for row in tgt]
    )
    difference = max(
        (ours[i, : len(score.log_probs)] - torch.tensor(score.log_probs)).abs().max().item()
        for i, score in enumerate(scores)
    )
    if enforce and not difference <= TOLERANCE:
        raise ExportError(
            f"the exported model's log-probabilities differ from {source.path}'s by {difference:.2e} "
            f"(more than {TOLERANCE}) on a probe batch: nothing written"
        )
    return difference
