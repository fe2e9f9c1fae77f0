"""The encoder and decoder stacks (Vaswani et al., 2017, Section 3.1): N layers each, plus a final
LayerNorm when pre-LN. Each stack runs padded batches, packed tokens (`forward_packed`) and, for the
decoder, incremental decoding over a `DecoderCache`. With activation checkpointing on, training
passes keep only each layer's input and recompute the layer in the backward pass; with `compile_layers`,
training passes over padded batches run each stack's layers through one compiled `forward`.

Layers and stacks take small explicit arguments, as torch's do; `Encoder.of(config)` / `Decoder.of(config)`
are the builders, the one place that reads the layers' arguments from a `TransformerConfig`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch._dynamo
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from transformer.config import Activation, TransformerConfig
from transformer.inductor import compile_options
from transformer.kernels import RotaryLike, attention_dtype
from transformer.kv_cache import DecoderCache
from transformer.layers import DecoderLayer, EncoderLayer
from transformer.norm import LayerNorm
from transformer.packing import TokenPacking

_Stack = TypeVar("_Stack", bound="_LayerStack")

__all__ = [
    "CompiledLayerCall",
    "Decoder",
    "Encoder",
    "checkpoint_layers",
    "compile_layers",
]


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
        activation: Activation = "relu",
        norm_first: bool = False,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            self._layer(d_model, n_heads, d_ff, dropout, attention_dropout, activation, norm_first, norm_eps)
            for _ in range(n_layers)
        )
        # pre-LN leaves the residual stream un-normalized; post-LN layers already end with a norm
        self.norm = LayerNorm(d_model, eps=norm_eps) if norm_first else None

    # recompute each layer in the backward pass instead of keeping its activations (training only)
    activation_checkpointing: bool = False
    # the layers through one torch.compile'd call in training (`compile_layers`); None: eager
    compiled_call: CompiledLayerCall | None = None

    @classmethod
    def _of(cls: type[_Stack], config: TransformerConfig, n_layers: int) -> _Stack:
        """n_layers layers with the arguments `config` gives every layer (read here only)."""
        return cls(
            config.d_model,
            config.n_heads,
            config.d_ff,
            n_layers,
            config.dropout,
            config.attention_dropout,
            config.activation,
            config.norm_first,
            config.norm_eps,
        )

    def _final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm is not None else x

    def _layer_call(self, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """`layer(*args, **kwargs)` (a layer's own arguments, passed through). In a pass that builds a graph:
        through the stack's compiled call when its layers are compiled (padded inputs), and via
        `torch.utils.checkpoint` when checkpointing (non-reentrant, which saves and restores the RNG state,
        so dropout draws the same masks when the layer runs again in the backward pass)."""
        call: Callable[..., Any] = layer
        if self.training and torch.is_grad_enabled():
            if self.compiled_call is not None and kwargs.get("packing") is None:
                call = functools.partial(self.compiled_call, layer)
            if self.activation_checkpointing:
                return checkpoint(call, *args, use_reentrant=False, **kwargs)
        return call(*args, **kwargs)


class Encoder(_LayerStack):
    """A stack of `EncoderLayer`s (Section 3.1), with a final LayerNorm when pre-LN."""

    _layer = EncoderLayer

    @classmethod
    def of(cls, config: TransformerConfig) -> Encoder:
        """The encoder `config` describes: n_encoder_layers layers."""
        return cls._of(config, config.n_encoder_layers)

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
            x, _ = self._layer_call(layer, x, key_padding_mask, rotary=rotary, packing=packing)
        return self._final_norm(x)

    def _run(
        self, x: Tensor, key_padding_mask: Tensor | None, rotary: RotaryLike | None, need_weights: bool
    ) -> tuple[Tensor, list[Tensor]]:
        maps = []
        for layer in self.layers:
            x, weights = self._layer_call(
                layer, x, key_padding_mask, rotary=rotary, need_weights=need_weights
            )
            if weights is not None:
                maps.append(weights)
        return self._final_norm(x), maps


class Decoder(_LayerStack):
    """A stack of `DecoderLayer`s (Section 3.1), with a final LayerNorm when pre-LN."""

    _layer = DecoderLayer

    @classmethod
    def of(cls, config: TransformerConfig) -> Decoder:
        """The decoder `config` describes: n_decoder_layers layers."""
        return cls._of(config, config.n_decoder_layers)

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
            x, _, _ = self._layer_call(
                layer,
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
        if cache is not None:  # in the beam layout: a mask that picks each beam's keys
            dtype, heads = attention_dtype(x), self.layers[0].self_attn.num_heads
            self_mask, rotary = cache.start_step(x.shape[1], heads, rotary, dtype)
            memory_key_padding_mask = cache.memory_mask(memory_key_padding_mask, dtype)  # made once
        for i, layer in enumerate(self.layers):
            x, self_weights, cross_weights = self._layer_call(
                layer,
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


def checkpoint_layers(model: nn.Module, enabled: bool = True) -> int:
    """Turn activation checkpointing on (or off) in every encoder / decoder stack of `model`; returns how
    many layers it applies to (0: nothing to recompute)."""
    stacks = [module for module in model.modules() if isinstance(module, _LayerStack)]
    for stack in stacks:
        stack.activation_checkpointing = enabled
    return sum(len(stack.layers) for stack in stacks)


class CompiledLayerCall:
    """`layer(*args, **kwargs)` for the layers of one stack through one `torch.compile`d function, their
    class's `forward` (regional compilation). The layers are copies of one class, so it is traced and
    compiled once and every copy reuses the code, its weights being the graph's inputs: compiling takes
    about the time of one layer per stack instead of the whole model's (2.4x less on the CPU for the
    WMT-base training step, docs/gpu.md). Every dimension of a tensor argument is marked dynamic
    but a floating tensor's last (d_model), so bucketed batches share the graph and two lengths that happen
    to be equal in the first batch are not assumed equal ever after (a recompilation when they differ)."""

    def __init__(
        self, layer_type: type[nn.Module], backend: str = "inductor", fullgraph: bool = False
    ) -> None:
        # the class's own code object: Dynamo counts the encoder's and the decoder's graphs apart
        options = compile_options(backend)
        self._compiled = torch.compile(layer_type.forward, backend=backend, fullgraph=fullgraph, **options)

    def __call__(self, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor):
                for dim in range(value.dim() - 1 if value.is_floating_point() else value.dim()):
                    torch._dynamo.maybe_mark_dynamic(value, dim)
        return self._compiled(layer, *args, **kwargs)


def compile_layers(model: nn.Module, backend: str = "inductor", fullgraph: bool = False) -> int:
    """Run the encoder and decoder layers of `model` through `torch.compile` in training passes over padded
    batches (one `CompiledLayerCall` per stack; evaluation, decoding and the packed path, whose shapes
    depend on the data, stay eager). Returns how many layers it applies to."""
    stacks = [module for module in model.modules() if isinstance(module, _LayerStack)]
    for stack in stacks:
        stack.compiled_call = CompiledLayerCall(stack._layer, backend, fullgraph)
    return sum(len(stack.layers) for stack in stacks)
