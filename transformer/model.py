"""The encoder and decoder stacks, the encoder-decoder Transformer and an encoder-only classifier.

Vaswani et al. (2017), Section 3: embeddings scaled by sqrt(D) plus positions, N layers per stack,
a final LayerNorm per stack when pre-LN, and a linear projection to the target vocabulary.
Full-sequence passes skip the padding ("unpadding", see `TokenPacking`): position-wise layers run on
the non-pad tokens only, attention on the padded layout; the numbers at real positions do not change.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from transformer.attention import KVCache, RotaryLike, TokenPacking
from transformer.config import TransformerConfig
from transformer.layers import DecoderLayer, Dropout, EncoderLayer
from transformer.positional import RotaryEmbedding, build_absolute_positional


class _LayerStack(nn.Module):
    """What `Encoder` and `Decoder` share: n_layers `_layer`s, with a final LayerNorm when pre-LN."""

    _layer: type[EncoderLayer] | type[DecoderLayer]

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        n_layers: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: Literal["relu", "gelu", "swiglu"] = "relu",
        norm_first: bool = False,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            self._layer(d_model, n_heads, d_ff, dropout, attention_dropout, activation, norm_first)
            for _ in range(n_layers)
        )
        # pre-LN leaves the residual stream un-normalized; post-LN layers already end with a norm
        self.norm = nn.LayerNorm(d_model) if norm_first else None

    def _final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm is not None else x


class Encoder(_LayerStack):
    """A stack of `EncoderLayer`s (Section 3.1), with a final LayerNorm when pre-LN."""

    _layer = EncoderLayer

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None, *, rotary: RotaryLike | None = None
    ) -> Tensor:
        """x (B, S, D) embedded source, key_padding_mask (B, S) True = pad -> memory (B, S, D)."""
        return self._run(x, key_padding_mask, rotary, need_weights=False)[0]

    def forward_with_attention(
        self, x: Tensor, key_padding_mask: Tensor | None = None, *, rotary: RotaryLike | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """As `forward`, plus each layer's self-attention weights (B, H, S, S)."""
        return self._run(x, key_padding_mask, rotary, need_weights=True)

    def forward_packed(
        self,
        x: Tensor,
        packing: TokenPacking,
        key_padding_mask: Tensor | None,
        *,
        rotary: RotaryLike | None = None,
    ) -> Tensor:
        """x (N, D): the embedded non-pad tokens of a (B, S) batch (`packing`) -> memory (N, D)."""
        for layer in self.layers:
            x, _ = layer(x, key_padding_mask, rotary=rotary, packing=packing)
        return self._final_norm(x)

    def _run(
        self, x: Tensor, key_padding_mask: Tensor | None, rotary: RotaryLike | None, need_weights: bool
    ) -> tuple[Tensor, list[Tensor]]:
        maps = []
        for layer in self.layers:
            x, weights = layer(x, key_padding_mask, rotary=rotary, need_weights=need_weights)
            if weights is not None:
                maps.append(weights)
        return self._final_norm(x), maps


class DecoderCache:
    """Incremental-decoding state of a `Decoder`: per layer a self- and a cross-attention `KVCache`.

    `offset` is the number of target positions already decoded (the position of the next one).
    `reorder(index)` selects batch rows (dropping finished sentences, or any row gather).
    `select_beams(parents, sentences)` switches to the beam layout, where the g = `beams` consecutive
    decoder rows of a sentence share one row of every cache: the cross-attention caches, the memory and
    its padding mask hold one row per sentence, and each self-attention cache row holds the keys and
    values of all the sentence's beams, g new ones per step, never moved. `key_paths` (n, g, t) says
    which of those keys form each beam's prefix, and attention masks out the rest, so a beam-search
    step re-points a few indices instead of gathering every layer's cache (fairseq and Hugging Face
    copy it all, O(t) per step).
    """

    def __init__(self, n_layers: int) -> None:
        self.self_attn = [KVCache(static=False) for _ in range(n_layers)]
        self.cross_attn = [KVCache(static=True) for _ in range(n_layers)]
        self.key_paths: Tensor | None = None  # (n, g, t) long, in the beam layout; None: row = hypothesis

    @property
    def beams(self) -> int:
        """g: decoder rows per cache row (1 outside the beam layout)."""
        return 1 if self.key_paths is None else self.key_paths.shape[1]

    @property
    def offset(self) -> int:
        return len(self.self_attn[0]) if self.key_paths is None else self.key_paths.shape[-1]

    def reserve(self, keys: int) -> None:
        """Allocate room for `keys` self-attention keys per row at the first step (no regrowth copies)."""
        for cache in self.self_attn:
            cache.reserved = keys

    def reorder(self, index: Tensor, memory_index: Tensor | None = None) -> None:
        """Keep rows `index` (LongTensor (B',)) of the self-attention caches and rows `memory_index` of the
        cross-attention caches (default: `index`, when each row has its own memory), in that order."""
        if self.key_paths is not None:
            raise RuntimeError("reorder() selects hypotheses; in the beam layout use select_beams()")
        self._reorder(self.self_attn, index)
        self._reorder(self.cross_attn, index if memory_index is None else memory_index)

    def select_beams(self, parents: Tensor, sentences: Tensor) -> None:
        """The next step's beams: for each kept sentence i (`sentences` (n',) rows of the current ones),
        new beam j extends the current beam `parents[i, j]` ((n', g') long, in 0 .. beams - 1).

        The first call turns a cache of one hypothesis per row into the beam layout."""
        if self.key_paths is None:
            held = len(self.self_attn[0])
            rows = 0 if self.self_attn[0].key is None else self.self_attn[0].key.shape[0]
            self.key_paths = torch.arange(held, device=parents.device).expand(rows, 1, held)
        paths = self.key_paths.index_select(0, sentences)  # (n', g, t)
        self.key_paths = paths.gather(1, parents.unsqueeze(-1).expand(-1, -1, paths.shape[-1]))  # (n', g', t)
        self._reorder(self.self_attn, sentences)
        self._reorder(self.cross_attn, sentences)

    def step_mask(self, heads: int) -> Tensor | None:
        """In the beam layout, start a step: each beam's new key goes after the cached ones, and the
        returned (n * heads, g, S) bool mask (True = masked, nn.MultiheadAttention's polarity) lets a
        beam's query see its prefix and its own new key only. None outside the beam layout."""
        if self.key_paths is None:
            return None
        sentences, beams, _ = self.key_paths.shape
        cached = len(self.self_attn[0])
        new_keys = torch.arange(cached, cached + beams, device=self.key_paths.device)
        self.key_paths = torch.cat([self.key_paths, new_keys.expand(sentences, beams).unsqueeze(-1)], dim=-1)
        masked = torch.ones(sentences, 1, beams, cached + beams, dtype=torch.bool, device=new_keys.device)
        masked.scatter_(-1, self.key_paths.unsqueeze(1), False)  # (n, 1, g, S)
        return masked.expand(-1, heads, -1, -1).reshape(sentences * heads, beams, cached + beams)

    @staticmethod
    def _reorder(caches: list[KVCache], index: Tensor) -> None:
        held = 0 if caches[0].key is None else caches[0].key.shape[0]
        if index.numel() == held and bool((index == torch.arange(held, device=index.device)).all()):
            return  # the same rows in the same order: nothing to copy
        for cache in caches:
            cache.reorder(index)


class Decoder(_LayerStack):
    """A stack of `DecoderLayer`s (Section 3.1), with a final LayerNorm when pre-LN."""

    _layer = DecoderLayer

    def new_cache(self) -> DecoderCache:
        return DecoderCache(len(self.layers))

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_key_padding_mask: Tensor | None = None,
        *,
        cache: DecoderCache | None = None,
        rotary: RotaryLike | None = None,
    ) -> Tensor:
        """x (B, T, D) embedded target, memory (B, S, D), memory_key_padding_mask (B, S) -> (B, T, D).

        Self-attention is causal. Right-padded targets need no padding mask of their own: a real
        position never sees a later pad, and pad positions' outputs are ignored by the loss.
        With `cache`, x holds only the new position(s), which attend to everything cached.
        """
        return self._run(x, memory, memory_key_padding_mask, cache, rotary, need_weights=False)[0]

    def forward_with_attention(
        self,
        x: Tensor,
        memory: Tensor,
        memory_key_padding_mask: Tensor | None = None,
        *,
        rotary: RotaryLike | None = None,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """As `forward`, plus per-layer self (B, H, T, T) and cross (B, H, T, S) attention weights."""
        return self._run(x, memory, memory_key_padding_mask, None, rotary, need_weights=True)

    def forward_packed(
        self,
        x: Tensor,
        packing: TokenPacking,
        memory: Tensor,
        memory_packing: TokenPacking,
        memory_key_padding_mask: Tensor | None,
        *,
        rotary: RotaryLike | None = None,
    ) -> Tensor:
        """x (N, D): embedded target tokens kept by `packing` of a (B, T) batch; memory (M, D) likewise
        for (B, S) -> (N, D). Every kept row must hold a prefix (causal attention sees only earlier ones)."""
        for layer in self.layers:
            x, _, _ = layer(
                x,
                memory,
                memory_key_padding_mask,
                rotary=rotary,
                packing=packing,
                memory_packing=memory_packing,
            )
        return self._final_norm(x)

    def _run(
        self,
        x: Tensor,
        memory: Tensor,
        memory_key_padding_mask: Tensor | None,
        cache: DecoderCache | None,
        rotary: RotaryLike | None,
        need_weights: bool,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        self_maps, cross_maps = [], []
        self_mask = None
        if cache is not None and cache.key_paths is not None:  # the beam layout: one new position per beam
            if x.shape[1] != 1:
                raise ValueError(f"a beam-layout DecoderCache takes one position per step, got {x.shape[1]}")
            position = cache.offset
            self_mask = cache.step_mask(self.layers[0].self_attn.num_heads)
            if rotary is not None:
                rotary = _at_position(rotary, position)
        for i, layer in enumerate(self.layers):
            x, self_weights, cross_weights = layer(
                x,
                memory,
                memory_key_padding_mask,
                self_cache=cache.self_attn[i] if cache is not None else None,
                cross_cache=cache.cross_attn[i] if cache is not None else None,
                memory_group=cache.beams if cache is not None else 1,
                self_mask=self_mask,
                rotary=rotary,
                need_weights=need_weights,
            )
            if self_weights is not None and cross_weights is not None:
                self_maps.append(self_weights)
                cross_maps.append(cross_weights)
        return self._final_norm(x), self_maps, cross_maps


def _at_position(rotary: RotaryLike, position: int) -> RotaryLike:
    """Rotary for the beam layout: all g new keys / queries of a sentence, (n, H, g, Dh), sit at
    `position`, whatever the number of keys already cached."""

    def rotate(x: Tensor, offset: int) -> Tensor:
        return rotary(x.reshape(x.shape[0], -1, 1, x.shape[-1]), position).view(x.shape)

    return rotate


class _Embedder(nn.Module):
    """Token embedding * sqrt(D) (Section 3.4), plus absolute positions (Section 3.5), then dropout."""

    def __init__(self, embedding: nn.Embedding, positional: nn.Module | None, dropout: float) -> None:
        super().__init__()
        self.embedding = embedding
        self.positional = positional
        self.scale = math.sqrt(embedding.embedding_dim)
        self.dropout = Dropout(dropout)

    def forward(self, tokens: Tensor, offset: int = 0, packing: TokenPacking | None = None) -> Tensor:
        """tokens (B, T) long at positions offset .. offset+T-1 -> (B, T, D), or (N, D) for the
        positions that `packing` keeps."""
        if packing is None:
            x = self.embedding(tokens) * self.scale  # (B, T, D)
            if self.positional is not None:
                x = self.positional(x, offset)
            return self.dropout(x)
        x = self.embedding(packing.pack(tokens)) * self.scale  # (N, D)
        if self.positional is not None:
            # the encodings of positions offset .. offset+T-1 (the module adds them to zeros), then per token
            table = self.positional(x.new_zeros(1, packing.length, x.size(-1)), offset)[0]  # (T, D)
            x = x + table.index_select(0, packing.positions)  # (N, D)
        return self.dropout(x)


def _build_positional(config: TransformerConfig) -> nn.Module | None:
    return build_absolute_positional(config.positional, config.d_model, config.max_len)


def _build_rotary(config: TransformerConfig) -> RotaryEmbedding | None:
    return RotaryEmbedding(config.d_head, config.max_len) if config.positional == "rope" else None


def _build_encoder(config: TransformerConfig) -> Encoder:
    return Encoder(
        config.d_model,
        config.n_heads,
        config.d_ff,
        config.n_encoder_layers,
        config.dropout,
        config.attention_dropout,
        config.activation,
        config.norm_first,
    )


def _init_weights(module: nn.Module) -> None:
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
            if isinstance(embedder, _Embedder):
                nn.init.normal_(embedder.embedding.weight, std=embedder.embedding.embedding_dim**-0.5)


def _prefix_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """(B, T) bool: every position up to each row's last non-pad token (all that a causal decoder needs)."""
    positions = torch.arange(1, tokens.size(1) + 1, device=tokens.device)  # (T,)
    lengths = (tokens.ne(pad_id) * positions).amax(dim=1, keepdim=True)  # (B, 1) last non-pad position + 1
    return positions <= lengths  # (B, T)


class Seq2SeqTransformer(nn.Module):
    """The encoder-decoder Transformer (Section 3, Figure 1); padding masks come from `config.pad_id`.

    `pack_tokens`: full-sequence passes (`forward`, `encode`) run their position-wise layers on the
    non-pad tokens only. None (the default) packs on the CPU and not on a GPU: a training step on the CPU
    is 1.23x / 1.34x faster packed (d256 / d512), on an H100 in bf16 1.33x / 1.16x *slower* (the gathers'
    kernel launches and host syncs cost more than the skipped padding; README Performance). False gives
    fixed shapes (torch.compile, CUDA graphs). Outputs at real positions are the same either way; padded
    positions come out as zeros.
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
        self.output_projection = nn.Linear(d_model, config.tgt_vocab_size, bias=False)
        tgt_embedding = nn.Embedding(config.tgt_vocab_size, d_model)
        if config.tie_embeddings in ("decoder", "all"):
            tgt_embedding.weight = self.output_projection.weight  # one (V, D) matrix (Section 3.4)
        src_embedding = (
            tgt_embedding if config.tie_embeddings == "all" else nn.Embedding(config.src_vocab_size, d_model)
        )
        # sinusoids are a fixed table, so one module serves both sides; learned positions get one per side
        src_positional = _build_positional(config)
        tgt_positional = src_positional if config.positional == "sinusoidal" else _build_positional(config)
        self.src_embed = _Embedder(src_embedding, src_positional, config.dropout)
        self.tgt_embed = _Embedder(tgt_embedding, tgt_positional, config.dropout)
        self.rotary = _build_rotary(config)
        self.encoder = _build_encoder(config)
        self.decoder = Decoder(
            d_model,
            config.n_heads,
            config.d_ff,
            config.n_decoder_layers,
            config.dropout,
            config.attention_dropout,
            config.activation,
            config.norm_first,
        )
        _init_weights(self)

    def padding_mask(self, tokens: Tensor) -> Tensor:
        """tokens (B, L) long -> (B, L) bool, True where tokens == pad_id."""
        return tokens.eq(self.config.pad_id)

    def encode(self, src: Tensor) -> Tensor:
        """src (B, S) long -> memory (B, S, D)."""
        src_padding_mask = self.padding_mask(src)
        if self._packing_on(src.device) and src_padding_mask.any():
            memory, packing = self._encode_packed(src, src_padding_mask)
            return packing.unpack(memory)  # (B, S, D), zeros at pads (masked as keys anyway)
        return self.encoder(self.src_embed(src), src_padding_mask, rotary=self.rotary)

    def _encode_packed(self, src: Tensor, src_padding_mask: Tensor) -> tuple[Tensor, TokenPacking]:
        """src (B, S) -> memory (M, D) of the M non-pad tokens, and their packing."""
        packing = TokenPacking(~src_padding_mask)
        embedded = self.src_embed(src, packing=packing)  # (M, D)
        return self.encoder.forward_packed(embedded, packing, src_padding_mask, rotary=self.rotary), packing

    def _forward_packed(self, src: Tensor, tgt_in: Tensor) -> tuple[Tensor, TokenPacking]:
        """src (B, S), tgt_in (B, T) -> decoder outputs (N, D) over each target's prefix and their packing."""
        src_padding_mask = self.padding_mask(src)
        memory, src_packing = self._encode_packed(src, src_padding_mask)  # (M, D)
        packing = TokenPacking(_prefix_mask(tgt_in, self.config.pad_id))
        embedded = self.tgt_embed(tgt_in, packing=packing)  # (N, D)
        hidden = self.decoder.forward_packed(
            embedded, packing, memory, src_packing, src_padding_mask, rotary=self.rotary
        )
        return hidden, packing  # (N, D)

    def _packing_on(self, device: torch.device) -> bool:
        return device.type == "cpu" if self.pack_tokens is None else self.pack_tokens

    def _packs(self, src: Tensor, tgt_in: Tensor) -> bool:
        return self._packing_on(src.device) and bool(
            src.eq(self.config.pad_id).any() or tgt_in.eq(self.config.pad_id).any()
        )

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
        self, src: Tensor, tgt_in: Tensor, *, return_hidden: bool = False, positions: Tensor | None = None
    ) -> Tensor:
        """src (B, S), tgt_in (B, T) long -> logits (B, T, V), or the final hidden states (B, T, D).

        `return_hidden` lets a loss project to the vocabulary itself via `output_projection`.
        `positions` (B, T) bool: only the outputs at those positions, (N, V) or (N, D) in row-major
        order (= the full output[positions]), without building the padded (B, T, ...) tensor; for a
        loss, positions = tgt_out != pad.
        """
        if not self._packs(src, tgt_in):
            src_padding_mask = self.padding_mask(src)
            memory = self.encoder(self.src_embed(src), src_padding_mask, rotary=self.rotary)
            out = self.decode(tgt_in, memory, src_padding_mask, return_hidden=return_hidden)
            return out if positions is None else out[positions]
        hidden, packing = self._forward_packed(src, tgt_in)  # (N', D) over each target's prefix
        if positions is not None and not torch.equal(packing.keep, positions):
            hidden = packing.unpack(hidden)[positions]  # (N, D); usually positions == the prefixes
            packing = None
        out = hidden if return_hidden else self.output_projection(hidden)
        return out if positions is not None or packing is None else packing.unpack(out)

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


class _EncoderOnly(nn.Module):
    """Embeddings + encoder stack, shared by the classifier and the masked-LM pretraining model: the same
    parameter names (`src_embed.*`, `encoder.*`), so pretrained weights load into a classifier."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.src_embed = _Embedder(
            nn.Embedding(config.src_vocab_size, config.d_model), _build_positional(config), config.dropout
        )
        self.rotary = _build_rotary(config)
        self.encoder = _build_encoder(config)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) long -> hidden states (B, S, D), padding mask (B, S) True = pad."""
        padding_mask = src.eq(self.config.pad_id)  # (B, S)
        return self.encoder(self.src_embed(src), padding_mask, rotary=self.rotary), padding_mask

    def attention_maps(self, src: Tensor) -> dict[str, list[Tensor]]:
        """Per-layer encoder self-attention weights under "encoder_self", each (B, H, S, S)."""
        _, maps = self.encoder.forward_with_attention(
            self.src_embed(src), src.eq(self.config.pad_id), rotary=self.rotary
        )
        return {"encoder_self": maps}


class TransformerClassifier(_EncoderOnly):
    """Encoder-only Transformer with a linear head on a pooled representation (cf. BERT)."""

    def __init__(
        self, config: TransformerConfig, num_classes: int, pooling: Literal["cls", "mean", "max"] = "cls"
    ) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        if pooling not in ("cls", "mean", "max"):
            raise ValueError(f"pooling must be 'cls', 'mean' or 'max', got {pooling!r}")
        super().__init__(config)
        self.pooling = pooling
        self.dropout = Dropout(config.dropout)
        self.head = nn.Linear(config.d_model, num_classes)
        _init_weights(self)

    def forward(self, src: Tensor) -> Tensor:
        """src (B, S) long -> logits (B, C); "cls" pools position 0 (BOS), "mean" averages the non-pad
        positions, "max" takes each feature's maximum over them (max-over-time, as in Kim, 2014)."""
        hidden, padding_mask = self.encode(src)  # (B, S, D), (B, S)
        if self.pooling == "cls":
            pooled = hidden[:, 0]  # (B, D)
        elif self.pooling == "mean":
            keep = (~padding_mask).unsqueeze(-1).to(hidden.dtype)  # (B, S, 1)
            pooled = (hidden * keep).sum(1) / keep.sum(1).clamp(min=1.0)  # (B, D)
        else:  # every row has its BOS, so no row is all padding
            pooled = hidden.masked_fill(padding_mask.unsqueeze(-1), -math.inf).amax(dim=1)  # (B, D)
        return self.head(self.dropout(pooled))


class TransformerMaskedLM(_EncoderOnly):
    """Encoder-only Transformer pretrained to predict masked tokens (BERT's masked LM, Devlin et al., 2019).

    The head is BERT's: dense + GELU + LayerNorm, then the output projection tied to the input embedding
    (plus a bias). Only the encoder (`src_embed.*`, `encoder.*`) is meant to be kept for fine-tuning.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        D = config.d_model
        self.lm_transform = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D))
        self.lm_bias = nn.Parameter(torch.zeros(config.src_vocab_size))
        _init_weights(self)

    def forward(self, src: Tensor, positions: Tensor) -> Tensor:
        """src (B, S) long with some tokens masked, positions (B, S) bool: where to predict ->
        logits (N, V) over the vocabulary for the N positions, in row-major order."""
        hidden, _ = self.encode(src)  # (B, S, D)
        selected = self.lm_transform(hidden[positions])  # (N, D)
        return nn.functional.linear(selected, self.src_embed.embedding.weight, self.lm_bias)  # (N, V)
