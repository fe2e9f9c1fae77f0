"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017, Section 3).

Embeddings scaled by sqrt(D) plus positions (`transformer.embedding`), the encoder and decoder stacks
(`transformer.stacks`) and a linear projection to the target vocabulary. Full-sequence passes skip the
padding (`transformer.packing`): position-wise layers run on the non-pad tokens only, attention on the
padded layout or, with a host-built packing on CUDA, torch's variable-length kernel; the numbers at real
positions do not change. The encoder-only models live in
`transformer.encoder_only` and are importable from here too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transformer.config import TransformerConfig
from transformer.embedding import Embedder, build_positional, build_rotary, init_weights
from transformer.encoder_only import TransformerClassifier, TransformerMaskedLM
from transformer.kv_cache import DecoderCache
from transformer.packing import BatchPacking, TokenPacking, prefix_mask
from transformer.stacks import Decoder, Encoder

__all__ = [
    "Decoder",
    "DecoderCache",
    "Encoder",
    "Seq2SeqTransformer",
    "TransformerClassifier",
    "TransformerMaskedLM",
]


class Seq2SeqTransformer(nn.Module):
    """The encoder-decoder Transformer (Section 3, Figure 1); padding masks come from `config.pad_id`.

    `pack_tokens`: full-sequence passes (`forward`, `encode`) run their position-wise layers on the
    non-pad tokens only. None (the default) packs on the CPU and not on a GPU: a training step on the CPU
    is 1.23x / 1.34x faster packed (d256 / d512), on an H100 in bf16 1.33x / 1.16x *slower* (the gathers'
    kernel launches and host syncs cost more than the skipped padding; README Performance). False gives
    fixed shapes (CUDA graphs); code that `torch.compile` traces never packs. Outputs at real positions
    are the same either way; padded positions come out as zeros.
    """

    pack_tokens: bool | None = None

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if config.n_decoder_layers < 1:
            raise ValueError(
                f"Seq2SeqTransformer needs n_decoder_layers >= 1, got {config.n_decoder_layers} "
                "(an encoder-only model is TransformerClassifier)"
            )
        self.config = config
        d_model = config.d_model
        self.output_projection = nn.Linear(d_model, config.tgt_vocab_size, bias=config.output_bias)
        tgt_embedding = nn.Embedding(config.tgt_vocab_size, d_model)
        if config.tie_embeddings in ("decoder", "all"):
            tgt_embedding.weight = self.output_projection.weight  # one (V, D) matrix (Section 3.4)
        src_embedding = (
            tgt_embedding if config.tie_embeddings == "all" else nn.Embedding(config.src_vocab_size, d_model)
        )
        # sinusoids are a fixed table, so one module serves both sides; learned positions get one per side
        src_positional = build_positional(config)
        tgt_positional = src_positional if config.positional == "sinusoidal" else build_positional(config)
        self.src_embed = Embedder.of(config, src_embedding, src_positional)
        self.tgt_embed = Embedder.of(config, tgt_embedding, tgt_positional)
        self.rotary = build_rotary(config)
        self.encoder = Encoder.of(config)
        self.decoder = Decoder.of(config)
        init_weights(self)

    def padding_mask(self, tokens: Tensor) -> Tensor:
        """tokens (B, L) long -> (B, L) bool, True where tokens == pad_id."""
        return tokens.eq(self.config.pad_id)

    def encode(self, src: Tensor) -> Tensor:
        """src (B, S) long -> memory (B, S, D)."""
        src_padding_mask = self.padding_mask(src)
        if self.packing_on(src.device) and src_padding_mask.any():
            memory, packing = self._encode_packed(src, src_padding_mask)
            return packing.unpack(memory)  # (B, S, D), zeros at pads (masked as keys anyway)
        return self.encoder(self.src_embed(src), src_padding_mask, rotary=self.rotary)

    def new_cache(self) -> DecoderCache:
        """An empty incremental-decoding state for `decode(..., cache=...)`."""
        return self.decoder.new_cache()

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        src_padding_mask: Tensor | None,
        cache: DecoderCache | None = None,
        *,
        return_hidden: bool = False,
    ) -> Tensor:
        """tgt_in (B, T) long, memory (B, S, D), src_padding_mask (B, S) True = pad -> logits (B, T, V).

        With `cache`, tgt_in holds only the new position(s) (after the `cache.offset` already decoded)
        and the cache is extended in place; the cross-attention keys/values of `memory` are projected
        on the first cached call and reused afterwards (later calls do not read `memory`).
        """
        offset = cache.offset if cache is not None else 0
        hidden = self.decoder(
            self.tgt_embed(tgt_in, offset), memory, src_padding_mask, cache=cache, rotary=self.rotary
        )  # (B, T, D)
        return hidden if return_hidden else self.output_projection(hidden)

    def forward(
        self,
        src: Tensor,
        tgt_in: Tensor,
        *,
        return_hidden: bool = False,
        positions: Tensor | None = None,
        packing: BatchPacking | None = None,
    ) -> Tensor:
        """src (B, S), tgt_in (B, T) long -> logits (B, T, V), or the final hidden states (B, T, D).

        `return_hidden` lets a loss project to the vocabulary itself via `output_projection`.
        `positions` (B, T) bool: only the outputs at those positions, (N, V) or (N, D) in row-major
        order (= the full output[positions]), without building the padded (B, T, ...) tensor; for a
        loss, positions = tgt_out != pad.
        `packing`, built on the host (the collator's): the packed path on any device with nothing read
        back; the outputs are those at `packing.target`'s positions, (N, V) or (N, D) (for a loss, the
        targets are `packing.target.pack(tgt_out)`, pads among them ignored); `positions` must be None.
        """
        if packing is not None:
            if positions is not None:
                raise ValueError("forward takes positions or packing, not both (packing names the outputs)")
            return self._forward_packed(src, tgt_in, return_hidden, None, packing)
        if self._packs(src, tgt_in):
            return self._forward_packed(src, tgt_in, return_hidden, positions)
        src_padding_mask = self.padding_mask(src)
        memory = self.encoder(self.src_embed(src), src_padding_mask, rotary=self.rotary)
        out = self.decode(tgt_in, memory, src_padding_mask, return_hidden=return_hidden)
        return out if positions is None else out[positions]

    def attention_maps(self, src: Tensor, tgt_in: Tensor) -> dict[str, list[Tensor]]:
        """Per-layer attention weights: "encoder_self" (B, H, S, S), "decoder_self" (B, H, T, T),
        "cross" (B, H, T, S); heads are kept apart (not averaged)."""
        src_padding_mask = self.padding_mask(src)
        memory, encoder_maps = self.encoder.forward_with_attention(
            self.src_embed(src), src_padding_mask, rotary=self.rotary
        )
        _, self_maps, cross_maps = self.decoder.forward_with_attention(
            self.tgt_embed(tgt_in), memory, src_padding_mask, rotary=self.rotary
        )
        return {"encoder_self": encoder_maps, "decoder_self": self_maps, "cross": cross_maps}

    # The packed path (`transformer.packing`): when it is taken, and the passes over packed tokens.

    def packing_on(self, device: torch.device) -> bool:
        """Whether full-sequence passes on `device` pack the non-pad tokens (`pack_tokens`)."""
        if torch.compiler.is_compiling():  # the packing's shapes depend on the data: no fixed graph
            return False
        return device.type == "cpu" if self.pack_tokens is None else self.pack_tokens

    def _packs(self, src: Tensor, tgt_in: Tensor) -> bool:
        return self.packing_on(src.device) and bool(
            src.eq(self.config.pad_id).any() or tgt_in.eq(self.config.pad_id).any()
        )

    def _encode_packed(
        self, src: Tensor, src_padding_mask: Tensor, packing: TokenPacking | None = None
    ) -> tuple[Tensor, TokenPacking]:
        """src (B, S) -> memory (M, D) of the M non-pad tokens, and their packing (found if not given)."""
        packing = TokenPacking(~src_padding_mask) if packing is None else packing
        embedded = self.src_embed(src, packing=packing)  # (M, D)
        return self.encoder.forward_packed(embedded, packing, src_padding_mask, rotary=self.rotary), packing

    def _forward_packed(
        self,
        src: Tensor,
        tgt_in: Tensor,
        return_hidden: bool,
        positions: Tensor | None,
        batch_packing: BatchPacking | None = None,
    ) -> Tensor:
        """`forward` with every stack on packed tokens: the decoder runs over each target's prefix. With
        `batch_packing` the outputs stay packed, (N', ...) at its target positions."""
        src_padding_mask = self.padding_mask(src)
        if batch_packing is not None:
            memory, src_packing = self._encode_packed(src, src_padding_mask, batch_packing.source)  # (M, D)
            packing = batch_packing.target
        else:
            memory, src_packing = self._encode_packed(src, src_padding_mask)  # (M, D)
            packing = TokenPacking(prefix_mask(tgt_in, self.config.pad_id))
        embedded = self.tgt_embed(tgt_in, packing=packing)  # (N', D)
        hidden = self.decoder.forward_packed(
            embedded, packing, memory, src_packing, src_padding_mask, rotary=self.rotary
        )  # (N', D) over each target's prefix
        if batch_packing is not None:
            return hidden if return_hidden else self.output_projection(hidden)  # (N', ...)
        if positions is None:
            return packing.unpack(hidden if return_hidden else self.output_projection(hidden))  # (B, T, ...)
        if not torch.equal(packing.keep, positions):  # usually positions == the prefixes
            hidden = packing.unpack(hidden)[positions]  # (N, D)
        return hidden if return_hidden else self.output_projection(hidden)
