"""Scaled dot-product and multi-head attention (Vaswani et al., 2017, §3.2), the one attention in the project.

Owns `MultiHeadAttention` (a drop-in for `torch.nn.MultiheadAttention` plus a KV cache, a rotary hook and
a packed-token path), `KVCache` for incremental decoding, `TokenPacking` (padding removed around the
attention), `make_causal_mask`, and the single mask-merging helper.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["KVCache", "MultiHeadAttention", "RotaryLike", "TokenPacking", "make_causal_mask"]

# rotary(x: (B, H, L, Dh), offset: int) -> (B, H, L, Dh); offset = positions already in the cache.
RotaryLike = Callable[[Tensor, int], Tensor]

# Devices whose `F.scaled_dot_product_attention` kernels already return 0 (and finite gradients) for a
# query row whose keys are all masked. Elsewhere (CUDA's memory-efficient kernel, pytorch#110213) we fix
# the rows up ourselves. tests/unit/test_attention.py checks the claim for CPU on the installed torch.
_SDPA_ZEROES_EMPTY_ROWS = frozenset({"cpu"})


def make_causal_mask(
    size: int, device: torch.device | str | None = None, *, num_keys: int | None = None
) -> Tensor:
    """Boolean (T, S) mask, True = masked out: query i may attend to keys 0 .. S - T + i.

    `size` is T; `num_keys` (S, default T) > T aligns the queries with the *last* T keys, which is
    where new positions sit when earlier keys come from a KV cache.
    """
    num_keys = size if num_keys is None else num_keys
    return torch.ones(size, num_keys, dtype=torch.bool, device=device).triu_(num_keys - size + 1)  # (T, S)


def _merge_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    batch: int,
    heads: int,
    n_extra: int,
    dtype: torch.dtype,
) -> Tensor | None:
    """Fold the torch-style masks into the one form `F.scaled_dot_product_attention` takes.

    Inputs use the `nn.MultiheadAttention` meaning (bool True = do not attend, float = added to the
    scores) and are already shape-checked: attn_mask (T, S) or (B*H, T, S), key_padding_mask (B, S).
    Returns None, a bool mask with SDPA's polarity (True = attend), or an additive float mask in `dtype`,
    broadcastable to (B, H, T, S + n_extra); the `n_extra` trailing columns (bias_k, zero attention)
    are always attended to. Nothing is expanded beyond what broadcasting needs: a padding mask alone
    stays (B, 1, 1, S).
    """
    masks = []
    if attn_mask is not None:
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.view(batch, heads, *attn_mask.shape[1:])  # (B*H, T, S) -> (B, H, T, S)
        masks.append(attn_mask)
    if key_padding_mask is not None:
        masks.append(key_padding_mask[:, None, None, :])  # (B, S) -> (B, 1, 1, S)
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        merged = masks[0] if len(masks) == 1 else masks[0] | masks[1]
        merged = ~merged  # SDPA's boolean polarity is the opposite of nn.MultiheadAttention's
        return F.pad(merged, (0, n_extra), value=True) if n_extra else merged
    # A float mask anywhere: bools become additive -inf (exactly zero weight after the softmax).
    additive = [
        torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(m, -math.inf)
        if m.dtype == torch.bool
        else m.to(dtype)
        for m in masks
    ]
    merged = additive[0] if len(additive) == 1 else additive[0] + additive[1]
    return F.pad(merged, (0, n_extra), value=0.0) if n_extra else merged


def _sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    fix_empty_rows: bool,
) -> Tensor:
    """F.scaled_dot_product_attention -> (B, H, T, Dh); query rows with every key masked give zeros."""
    empty = None
    if fix_empty_rows and mask is not None and q.device.type not in _SDPA_ZEROES_EMPTY_ROWS:
        empty = _empty_rows(mask)  # (…, T, 1)
        mask = mask | empty if mask.dtype == torch.bool else mask.masked_fill(empty, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal)  # (B, H, T, Dh)
    return out if empty is None else out.masked_fill(empty, 0.0)


def _empty_rows(mask: Tensor) -> Tensor:
    """Query rows (…, T, 1) whose keys are all masked in a mask from `_merge_masks`."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


class TokenPacking:
    """The kept tokens of a (B, L) batch as one (N, ...) tensor, and the way back ("unpadding").

    Position-wise work (projections, feed-forward, LayerNorm, dropout) on packed tokens skips the
    padding; attention unpacks to the padded (B, H, L, Dh) layout, where masks keep pads out.
    """

    def __init__(self, keep: Tensor) -> None:
        """keep (B, L) bool, True = a position that is computed."""
        self.batch, self.length = keep.shape
        self.keep = keep
        self.index = keep.reshape(-1).nonzero().squeeze(1)  # (N,) positions in the flattened B * L

    def __len__(self) -> int:
        return self.index.numel()

    @property
    def positions(self) -> Tensor:
        """(N,) long: each kept token's position within its row."""
        return self.index % self.length

    def pack(self, x: Tensor) -> Tensor:
        """(B, L, ...) -> (N, ...), the kept positions in row-major order (= x[keep])."""
        return x.reshape(self.batch * self.length, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, ...) -> (B, L, ...), zeros at the positions not kept (finite: masked keys stay harmless)."""
        out = x.new_zeros(self.batch * self.length, *x.shape[1:])
        return out.index_copy_(0, self.index, x).view(self.batch, self.length, *x.shape[1:])


class KVCache:
    """Projected keys and values of one attention layer, kept across decoding steps (§3.2.3, decoder).

    `static=False` (decoder self-attention): each call's `key`/`value` are only the new positions;
    their projections are appended and the query attends to everything cached so far.
    `static=True` (encoder-decoder attention): the first call projects `key`/`value` (the memory) and
    stores them; later calls reuse them and may pass `key=value=None`.

    A self-attention cache is stored position-major, (capacity, B, H, Dh), its capacity doubling when
    full (in multiples of `BLOCK` positions): an append writes one contiguous slab in place (no copy of
    the cache per step) and `reorder` gathers the filled prefix into a contiguous one. `key` / `value`
    are (B, H, S, Dh) views.
    """

    BLOCK = 16

    def __init__(self, static: bool = False) -> None:
        self.static = static
        # static: (B, H, S, Dh) as given; otherwise (capacity, B, H, Dh), positions >= len(self) unused
        self._key: Tensor | None = None
        self._value: Tensor | None = None
        self._length = 0
        self.reserved = 0  # the capacity the first append allocates, when the final length is known

    @property
    def key(self) -> Tensor | None:
        """(B, H, S, Dh) cached keys, or None."""
        return self._view(self._key)

    @property
    def value(self) -> Tensor | None:
        """(B, H, S, Dh) cached values, or None."""
        return self._view(self._value)

    def _view(self, buffer: Tensor | None) -> Tensor | None:
        if buffer is None or self.static:
            return buffer
        return buffer[: self._length].permute(1, 2, 0, 3)  # (S, B, H, Dh) -> (B, H, S, Dh)

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        shape = None if self.key is None else tuple(self.key.shape)
        return f"KVCache(static={self.static}, key_shape={shape})"

    def reorder(self, index: Tensor) -> None:
        """Select batch entries in place (beam search keeps, repeats or drops hypotheses)."""
        if self._key is None or self._value is None:
            return
        if self.static:
            self._key, self._value = self._key.index_select(0, index), self._value.index_select(0, index)
            return
        self._key, self._value = self._select(self._key, index), self._select(self._value, index)

    def _select(self, buffer: Tensor, index: Tensor) -> Tensor:
        """(capacity, B, H, Dh) -> (capacity, B', H, Dh) holding rows `index` of the filled positions."""
        if buffer.requires_grad and torch.is_grad_enabled():  # out= is not differentiable
            return buffer[: self._length].index_select(1, index)
        out = buffer.new_empty(buffer.shape[0], index.numel(), *buffer.shape[2:])
        torch.index_select(buffer[: self._length], 1, index, out=out[: self._length])  # contiguous prefix
        return out

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store new (B, H, L, Dh) keys/values (appended unless static) and return all cached ones."""
        if self.static:
            self._key, self._value, self._length = key, value, key.shape[2]
            return key, value
        new_key, new_value = key.permute(2, 0, 1, 3), value.permute(2, 0, 1, 3)  # (L, B, H, Dh)
        length = self._length + key.shape[2]
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            # training through a cache: autograd must see a concatenation, not in-place writes
            self._key = new_key if self._key is None else torch.cat([self._key[: self._length], new_key])
            self._value = (
                new_value if self._value is None else torch.cat([self._value[: self._length], new_value])
            )
        else:
            if self._key is None or self._value is None or length > self._key.shape[0]:
                self._key, self._value = (
                    self._grow(self._key, new_key, length),
                    self._grow(self._value, new_value, length),
                )
            self._key[self._length : length] = new_key
            self._value[self._length : length] = new_value
        self._length = length
        return self.key, self.value  # (B, H, S + L, Dh)

    def _grow(self, buffer: Tensor | None, new: Tensor, length: int) -> Tensor:
        """A (capacity, B, H, Dh) buffer with room for `length` positions that holds the filled part of
        `buffer`; the capacity at least doubles (rounded up to BLOCK), so n appends copy O(n) in all."""
        held = 0 if buffer is None else buffer.shape[0]
        capacity = -(-max(length, 2 * held, self.reserved) // self.BLOCK) * self.BLOCK
        grown = new.new_empty(capacity, *new.shape[1:])
        if buffer is not None and self._length:
            grown[: self._length] = buffer[: self._length]
        return grown


class MultiHeadAttention(nn.Module):
    """Multi-head attention (§3.2.2): Concat(head_1..head_h) W^O, head_i = Attention(QW_i^Q, KW_i^K, VW_i^V).

    Same constructor, forward, return values and `state_dict` as `torch.nn.MultiheadAttention`, plus a
    KV cache and a rotary hook; fully masked query rows give zeros instead of NaN.
    """

    bias_k: Tensor | None
    bias_v: Tensor | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim ({embed_dim}) and num_heads ({num_heads}) must be positive")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be in [0, 1], got {dropout}")
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = add_zero_attn

        # Registration order and initialisation mirror the torch module, so the same seed gives the
        # same weights and the state_dict keys come out in the same order.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def _linear(self, x: Tensor, part: slice, weight: Tensor | None) -> Tensor:
        """Project with rows `part` of the packed in_proj (views, no copy), or a separate weight."""
        bias = None if self.in_proj_bias is None else self.in_proj_bias[part]
        if weight is None:
            weight = self.in_proj_weight[part]
        return F.linear(x, weight, bias)

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        # (B, L, D) -> (B, L, H, Dh) -> (B, H, L, Dh)
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def _project(
        self, query: Tensor, key: Tensor | None, value: Tensor | None, same_qkv: bool, same_kv: bool
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Step 1, the input projections: one matmul for q, k, v in self-attention, one fused matmul for
        k and v when key is value; returns (B, H, T, Dh) and two (B, H, S, Dh) (None if key is None)."""
        d = self.embed_dim
        packed = self.in_proj_weight is not None
        if packed and same_qkv:
            # split (not unbind of a permuted view): its backward is one cat straight into (B, T, 3D)
            q, k, v = self._linear(query, slice(None), self.in_proj_weight).split(d, dim=-1)  # 3 x (B, T, D)
            return self._split_heads(q), self._split_heads(k), self._split_heads(v)  # 3 x (B, H, T, Dh)
        q = self._split_heads(self._linear(query, slice(0, d), self.q_proj_weight))  # (B, H, T, Dh)
        if key is None or value is None:
            return q, None, None
        if packed and same_kv:
            k, v = self._linear(key, slice(d, None), None).split(d, dim=-1)  # 2 x (B, S, D)
            return q, self._split_heads(k), self._split_heads(v)  # (B, H, T, Dh), 2 x (B, H, S, Dh)
        k = self._split_heads(self._linear(key, slice(d, 2 * d), self.k_proj_weight))  # (B, H, S, Dh)
        v = self._split_heads(self._linear(value, slice(2 * d, None), self.v_proj_weight))
        return q, k, v

    def _check_inputs(
        self, query: Tensor, key: Tensor | None, value: Tensor | None, static_hit: bool
    ) -> None:
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 2-D (L, E) or 3-D, got shape {tuple(query.shape)}")
        if query.shape[-1] != self.embed_dim:
            raise ValueError(f"query's last dim must be embed_dim={self.embed_dim}, got {tuple(query.shape)}")
        if static_hit:
            return
        if key is None or value is None:
            raise ValueError("key and value are required unless a filled static KVCache is given")
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"query, key and value must have the same number of dims, got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise ValueError(
                f"key/value last dims must be kdim={self.kdim}/vdim={self.vdim}, "
                f"got {tuple(key.shape)}/{tuple(value.shape)}"
            )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} differ before the last dim"
            )

    def forward(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        kv_cache: KVCache | None = None,
        rotary: RotaryLike | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from `query` (L, N, E) / (N, L, E) if batch_first / unbatched (L, E) to key/value.

        Masks as in `nn.MultiheadAttention`: bool True = do not attend, float = added to the scores;
        key_padding_mask (N, S), attn_mask (L, S) or (N*H, L, S). `is_causal` without attn_mask applies
        `make_causal_mask` itself; with attn_mask it is a hint that the mask is causal. With a
        non-static `kv_cache`, S counts the cached positions too; a filled static one is used instead
        of key/value (which may then be None). Returns (output, weights or None); weights are
        (N, L, S), or (N, H, L, S) when `average_attn_weights=False`.
        """
        static_hit = kv_cache is not None and kv_cache.static and kv_cache.key is not None
        self._check_inputs(query, key, value, static_hit)
        if rotary is not None and kv_cache is not None and kv_cache.static:
            raise ValueError("rotary is for self-attention; it cannot be combined with a static KVCache")
        same_kv = key is value and not static_hit
        same_qkv = same_kv and query is key
        is_batched = query.dim() == 3
        query, key, value, key_padding_mask = self._to_batch_first(
            query, None if static_hit else key, None if static_hit else value, key_padding_mask
        )
        batch, q_len, _ = query.shape
        cached = 0 if kv_cache is None else len(kv_cache)
        if kv_cache is not None and cached and kv_cache.key.shape[0] != batch:
            raise ValueError(f"KVCache holds batch size {kv_cache.key.shape[0]}, query has {batch}")
        if key is None:  # a filled static cache
            k_len = cached
        else:
            if key.shape[0] != batch:
                raise ValueError(f"query and key batch sizes differ: {batch} vs {key.shape[0]}")
            k_len = key.shape[1] + (cached if kv_cache is not None and not kv_cache.static else 0)
        self._check_masks(attn_mask, key_padding_mask, batch, q_len, k_len)  # before the cache changes

        # 1. project and split heads; rotary positions continue after what the cache holds
        q, k, v = self._project(query, key, value, same_qkv, same_kv)  # (B, H, T, Dh), (B, H, S, Dh) x 2
        if rotary is not None:
            q = rotary(q, cached)
            k = rotary(k, cached)
        if kv_cache is not None:
            k, v = (kv_cache.key, kv_cache.value) if key is None else kv_cache.update(k, v)  # (B, H, S, Dh)

        # 2. extra key/value columns of the torch module: learned bias_k/bias_v, then a zero key/value
        n_extra = 0
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self._split_heads(self.bias_k.to(k.dtype)).expand(batch, -1, -1, -1)], dim=2)
            v = torch.cat([v, self._split_heads(self.bias_v.to(v.dtype)).expand(batch, -1, -1, -1)], dim=2)
            n_extra += 1
        if self.add_zero_attn:
            k = F.pad(k, (0, 0, 0, 1))  # (B, H, S + 1, Dh)
            v = F.pad(v, (0, 0, 0, 1))
            n_extra += 1

        # 3. masks: SDPA's own causal kernel when that is exactly the mask, otherwise one merged mask
        sdpa_causal = False
        if is_causal and key_padding_mask is None and n_extra == 0 and q_len == k_len and not need_weights:
            sdpa_causal, attn_mask = True, None  # like the torch module, trust the is_causal hint
        elif is_causal and attn_mask is None and q_len > 1:
            attn_mask = make_causal_mask(q_len, q.device, num_keys=k_len)  # (T, S)
        mask = _merge_masks(attn_mask, key_padding_mask, batch, self.num_heads, n_extra, q.dtype)
        dropout_p = self.dropout if self.training else 0.0

        # 4. attend: fused kernel unless the weights are wanted
        if not need_weights:
            out, weights = _sdpa(q, k, v, mask, dropout_p, sdpa_causal, fix_empty_rows=n_extra == 0), None
        else:
            out, weights = self._attend_explicit(q, k, v, mask, dropout_p, n_extra)
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (B, H, T, S) -> (B, T, S)

        # 5. merge heads and project
        out = self.out_proj(out.transpose(1, 2).reshape(batch, q_len, self.embed_dim))  # (B, T, D)
        if not is_batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        if not self.batch_first:
            out = out.transpose(0, 1)  # (T, B, D)
        return out, weights

    def forward_packed(
        self,
        query: Tensor,
        key: Tensor,
        query_packing: TokenPacking,
        key_packing: TokenPacking,
        key_padding_mask: Tensor | None = None,
        *,
        is_causal: bool = False,
        rotary: RotaryLike | None = None,
    ) -> Tensor:
        """Attention between packed tokens: query (N, E) of a (B, T) batch, key = value (M, E) of (B, S).

        The same numbers as `forward(..., need_weights=False)` on the padded batch at the kept query
        positions, but the projections run on the N + M kept tokens only; the attention itself runs in
        the padded (B, H, T, S) layout. `key is query` means self-attention (one fused projection).
        key_padding_mask (B, S) True = pad; `is_causal` masks later keys. Returns (N, E).
        """
        if self.bias_k is not None or self.add_zero_attn or not self._qkv_same_embed_dim:
            raise ValueError("forward_packed supports neither add_bias_kv, add_zero_attn nor kdim/vdim")
        d = self.embed_dim
        if key is query:
            qkv = query_packing.unpack(self._linear(query, slice(None), None))  # (N, 3D) -> (B, T, 3D)
            q, k, v = (self._split_heads(t) for t in qkv.split(d, dim=-1))  # 3 x (B, H, T, Dh)
        else:
            q = self._split_heads(
                query_packing.unpack(self._linear(query, slice(0, d), None))
            )  # (B, H, T, Dh)
            kv = key_packing.unpack(self._linear(key, slice(d, None), None))  # (M, 2D) -> (B, S, 2D)
            k, v = (self._split_heads(t) for t in kv.split(d, dim=-1))  # 2 x (B, H, S, Dh)
        if rotary is not None:
            q, k = rotary(q, 0), rotary(k, 0)
        batch, q_len, k_len = query_packing.batch, query_packing.length, key_packing.length
        self._check_masks(None, key_padding_mask, batch, q_len, k_len)
        sdpa_causal = is_causal and key_padding_mask is None and q_len == k_len
        attn_mask = (
            make_causal_mask(q_len, q.device, num_keys=k_len) if is_causal and not sdpa_causal else None
        )
        mask = _merge_masks(attn_mask, key_padding_mask, batch, self.num_heads, 0, q.dtype)
        dropout_p = self.dropout if self.training else 0.0
        out = _sdpa(q, k, v, mask, dropout_p, sdpa_causal, fix_empty_rows=True)  # (B, H, T, Dh)
        out = query_packing.pack(out.transpose(1, 2))  # (B, T, H, Dh) -> (N, H, Dh)
        return self.out_proj(out.reshape(-1, d))  # (N, D)

    def _attend_explicit(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, n_extra: int
    ) -> tuple[Tensor, Tensor]:
        """softmax(QK^T / sqrt(Dh) + mask) V written out, for when the weights are returned."""
        # scaling q (T x Dh) is cheaper than scaling the scores (T x S) and makes the copy matmul needs anyway
        scores = torch.matmul(q * (1.0 / math.sqrt(self.head_dim)), k.transpose(-2, -1))  # (B, H, T, S)
        empty = None
        if mask is not None:
            if n_extra == 0:
                empty = _empty_rows(mask)  # (…, T, 1)
            scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
            if empty is not None:  # a finite row keeps softmax and its gradient NaN-free; zeroed below
                scores = scores.masked_fill(empty, 0.0)
        weights = torch.softmax(scores, dim=-1)
        if empty is not None:
            weights = weights.masked_fill(empty, 0.0)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        return torch.matmul(weights, v), weights  # (B, H, T, Dh), (B, H, T, S)

    def _to_batch_first(
        self, query: Tensor, key: Tensor | None, value: Tensor | None, key_padding_mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """Bring inputs to (B, L, E) and the padding mask to (B, S), whatever the caller's layout."""
        if query.dim() == 3:
            if self.batch_first:
                return query, key, value, key_padding_mask
            # the torch module's default layout is (L, N, E)
            key, value = (None if t is None else t.transpose(0, 1) for t in (key, value))
            return query.transpose(0, 1), key, value, key_padding_mask
        if key_padding_mask is not None:  # unbatched: (L, E) -> (1, L, E), (S,) -> (1, S)
            if key_padding_mask.dim() != 1:
                raise ValueError(
                    "key_padding_mask for unbatched input must have shape (S,), "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            key_padding_mask = key_padding_mask.unsqueeze(0)
        key, value = (None if t is None else t.unsqueeze(0) for t in (key, value))
        return query.unsqueeze(0), key, value, key_padding_mask

    def _check_masks(
        self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, batch: int, q_len: int, k_len: int
    ) -> None:
        """Raise ValueError naming the expected and received shape of a mask that does not fit."""
        for name, mask in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
            if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
                raise ValueError(f"{name} must be bool or floating point, got dtype {mask.dtype}")
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (batch, k_len):
            raise ValueError(
                f"key_padding_mask must have shape (N, S) = {(batch, k_len)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if attn_mask is not None:
            expected = [(q_len, k_len), (batch * self.num_heads, q_len, k_len)]
            if tuple(attn_mask.shape) not in expected:
                raise ValueError(
                    f"attn_mask must have shape (L, S) = {expected[0]} or (N*num_heads, L, S) = "
                    f"{expected[1]}, got {tuple(attn_mask.shape)}"
                )
