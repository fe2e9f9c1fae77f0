"""Multi-head attention (Vaswani et al., 2017, §3.2.2), the one attention in the project.

`MultiHeadAttention` is a drop-in for `torch.nn.MultiheadAttention` (same constructor, forward, return
values and `state_dict`) plus a KV cache (`transformer.kv_cache`), a rotary hook and a packed-token path
(`transformer.packing`). The kernels and mask conventions it uses live in `transformer.kernels`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.kernels import RotaryLike, attend, check_masks, make_causal_mask, use_varlen, varlen_attend
from transformer.kv_cache import KVCache
from transformer.packing import TokenPacking

__all__ = ["KVCache", "MultiHeadAttention", "RotaryLike", "TokenPacking", "make_causal_mask"]


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
        k_len = self._key_length(key, batch, kv_cache)
        check_masks(
            attn_mask, key_padding_mask, batch, self.num_heads, q_len, k_len
        )  # before the cache changes

        # 1. project and split heads; rotary positions and keys / values continue what the cache holds
        q, k, v = self._project(query, key, value, same_qkv, same_kv)  # (B, H, T, Dh), (B, H, S, Dh) x 2
        q, k, v = self._rotate_and_cache(q, k, v, kv_cache, rotary)
        # 2. extra key/value columns of the torch module (bias_k/bias_v, zero attention)
        k, v, n_extra = self._extra_columns(k, v, batch)
        # 3. attend: masks merged once, the fused kernel unless the weights are wanted
        dropout_p = self.dropout if self.training else 0.0
        out, weights = attend(
            q, k, v, attn_mask, key_padding_mask, is_causal=is_causal, need_weights=need_weights,
            n_extra=n_extra, dropout_p=dropout_p,
        )  # fmt: skip
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, H, T, S) -> (B, T, S)
        # 4. merge heads and project
        out = self.out_proj(out.transpose(1, 2).reshape(batch, q_len, self.embed_dim))  # (B, T, D)
        return self._to_caller_layout(out, weights, is_batched)

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
        positions, but the projections run on the N + M kept tokens only. The attention runs on them too,
        with torch's variable-length kernel, where `use_varlen` says it can; otherwise in the padded
        (B, H, T, S) layout. `key is query` means self-attention (one fused projection).
        key_padding_mask (B, S) True = pad; `is_causal` masks later keys (the query rows are prefixes).
        Returns (N, E).
        """
        if self.bias_k is not None or self.add_zero_attn or not self._qkv_same_embed_dim:
            raise ValueError("forward_packed supports neither add_bias_kv, add_zero_attn nor kdim/vdim")
        d = self.embed_dim
        dropout_p = self.dropout if self.training else 0.0
        if key is query:
            qkv = self._linear(query, slice(None), None)  # (N, 3D)
            kv = None
        else:
            qkv = self._linear(query, slice(0, d), None)  # (N, D)
            kv = self._linear(key, slice(d, None), None)  # (M, 2D)
        query_lengths = (query_packing.cu_seqlens, query_packing.max_len)
        key_lengths = (key_packing.cu_seqlens, key_packing.max_len)
        if use_varlen(qkv, self.head_dim, dropout_p, rotary is not None, query_lengths, key_lengths):
            heads = (-1, self.num_heads, self.head_dim)
            projected = qkv.split(d, dim=-1) if kv is None else (qkv, *kv.split(d, dim=-1))
            q, k, v = (t.view(heads) for t in projected)  # (N, H, Dh), 2 x (M, H, Dh)
            out = varlen_attend(q, k, v, query_lengths, key_lengths, is_causal=is_causal)  # (N, H, Dh)
            return self.out_proj(out.reshape(-1, d))  # (N, D)
        if kv is None:
            qkv = query_packing.unpack(qkv)  # (N, 3D) -> (B, T, 3D)
            q, k, v = (self._split_heads(t) for t in qkv.split(d, dim=-1))  # 3 x (B, H, T, Dh)
        else:
            q = self._split_heads(query_packing.unpack(qkv))  # (N, D) -> (B, H, T, Dh)
            kv = key_packing.unpack(kv)  # (M, 2D) -> (B, S, 2D)
            k, v = (self._split_heads(t) for t in kv.split(d, dim=-1))  # 2 x (B, H, S, Dh)
        if rotary is not None:
            q, k = rotary(q, 0), rotary(k, 0)
        batch, q_len, k_len = query_packing.batch, query_packing.length, key_packing.length
        check_masks(None, key_padding_mask, batch, self.num_heads, q_len, k_len)
        out, _ = attend(
            q, k, v, None, key_padding_mask, is_causal=is_causal, need_weights=False, dropout_p=dropout_p
        )  # (B, H, T, Dh)
        out = query_packing.pack(out.transpose(1, 2))  # (B, T, H, Dh) -> (N, H, Dh)
        return self.out_proj(out.reshape(-1, d))  # (N, D)

    def _rotate_and_cache(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        kv_cache: KVCache | None,
        rotary: RotaryLike | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Rotate q and k at positions after the cached ones; with a cache, k and v become every cached
        key / value (B, H, S, Dh): the new ones appended, or a filled static cache's (k = v = None)."""
        cached = 0 if kv_cache is None else len(kv_cache)
        if rotary is not None:
            q = rotary(q, cached)
            k = rotary(k, cached)
        if kv_cache is not None:
            k, v = (kv_cache.key, kv_cache.value) if k is None else kv_cache.update(k, v)  # (B, H, S, Dh)
        return q, k, v

    def _to_caller_layout(
        self, out: Tensor, weights: Tensor | None, is_batched: bool
    ) -> tuple[Tensor, Tensor | None]:
        """(B, T, D) back to the caller's layout: (T, D) unbatched, (T, B, D) unless batch_first."""
        if not is_batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        if not self.batch_first:
            out = out.transpose(0, 1)  # (T, B, D)
        return out, weights

    def _key_length(self, key: Tensor | None, batch: int, kv_cache: KVCache | None) -> int:
        """S: the keys attended to, cached ones included; checks the batch sizes agree."""
        cached = 0 if kv_cache is None else len(kv_cache)
        if kv_cache is not None and cached and kv_cache.key.shape[0] != batch:
            raise ValueError(f"KVCache holds batch size {kv_cache.key.shape[0]}, query has {batch}")
        if key is None:  # a filled static cache
            return cached
        if key.shape[0] != batch:
            raise ValueError(f"query and key batch sizes differ: {batch} vs {key.shape[0]}")
        return key.shape[1] + (cached if kv_cache is not None and not kv_cache.static else 0)

    def _extra_columns(self, k: Tensor, v: Tensor, batch: int) -> tuple[Tensor, Tensor, int]:
        """Append the torch module's extra key/value columns: learned bias_k/bias_v, then a zero key/value.
        Returns k, v (B, H, S + n_extra, Dh) and n_extra."""
        n_extra = 0
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self._split_heads(self.bias_k.to(k.dtype)).expand(batch, -1, -1, -1)], dim=2)
            v = torch.cat([v, self._split_heads(self.bias_v.to(v.dtype)).expand(batch, -1, -1, -1)], dim=2)
            n_extra += 1
        if self.add_zero_attn:
            k = F.pad(k, (0, 0, 0, 1))  # (B, H, S + 1, Dh)
            v = F.pad(v, (0, 0, 0, 1))
            n_extra += 1
        return k, v, n_extra

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
