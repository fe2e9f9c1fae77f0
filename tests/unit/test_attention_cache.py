"""MultiHeadAttention in incremental decoding: the KV cache (self attention step by step or in chunks, with
the rotary hook; the static cross-attention cache; beams reordered; growing in blocks, its capacity doubling)
equals the full causal pass."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from tests.helpers.attention import E, H, rope
from transformer import KVCache, MultiHeadAttention

# torch warns when key_padding_mask and attn_mask have different dtypes; mixing them is tested on purpose
pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched"),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("chunks", [[1] * 6, [3, 1, 2]], ids=["steps", "chunks"])
@pytest.mark.parametrize("use_rotary", [False, True])
def test_self_attention_cache_matches_full_causal(
    need_weights: bool, chunks: list[int], use_rotary: bool
) -> None:
    module = MultiHeadAttention(E, H, batch_first=True).eval()
    x = torch.randn(3, 6, E)
    offsets = []

    def rotary(t: Tensor, offset: int) -> Tensor:
        offsets.append(offset)
        return rope(t, offset)

    hook = rotary if use_rotary else None
    full, full_weights = module(
        x, x, x, is_causal=True, need_weights=need_weights, average_attn_weights=False, rotary=hook
    )
    cache = KVCache()
    start = 0
    for size in chunks:
        new = x[:, start : start + size]
        out, weights = module(
            new, new, new, is_causal=True, need_weights=need_weights, average_attn_weights=False,
            kv_cache=cache, rotary=hook,
        )  # fmt: skip
        torch.testing.assert_close(out, full[:, start : start + size], atol=1e-5, rtol=1e-5)
        if need_weights:  # (B, H, size, start + size): the full weights' rows, up to the last key seen
            expected = full_weights[:, :, start : start + size, : start + size]
            torch.testing.assert_close(weights, expected, atol=1e-5, rtol=1e-5)
        start += size
        assert len(cache) == start and cache.key.shape == (3, H, start, E // H)
    if use_rotary:
        assert offsets[:2] == [0, 0]  # full pass: q and k from position 0
        step_offsets = [
            o for size_start in itertools.accumulate([0, *chunks[:-1]]) for o in (size_start,) * 2
        ]
        assert offsets[2:] == step_offsets
        plain, _ = module(x, x, x, is_causal=True)
        assert not torch.allclose(plain, full)  # the hook really changes the numbers


def test_static_cross_cache_projects_memory_once() -> None:
    module = MultiHeadAttention(E, H, batch_first=True).eval()
    x, memory = torch.randn(2, 5, E), torch.randn(2, 7, E)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, 5:] = True
    full, full_weights = module(x, memory, memory, key_padding_mask=kpm)
    cache = KVCache(static=True)
    for t in range(5):
        # after the first call the memory is not read: None (or anything) gives the cached result
        keys = memory if t == 0 else (None if t % 2 else torch.randn(2, 7, E))
        out, weights = module(x[:, t : t + 1], keys, keys, key_padding_mask=kpm, kv_cache=cache)
        torch.testing.assert_close(out, full[:, t : t + 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(weights, full_weights[:, t : t + 1], atol=1e-5, rtol=1e-5)
        assert len(cache) == 7


def test_static_cache_rejects_rotary() -> None:
    module = MultiHeadAttention(E, H, batch_first=True)
    x = torch.randn(1, 2, E)
    with pytest.raises(ValueError, match="rotary"):
        module(x, x, x, kv_cache=KVCache(static=True), rotary=rope)


def test_cache_reorder_for_beams() -> None:
    decoder_self = MultiHeadAttention(E, H, batch_first=True).eval()
    cross = MultiHeadAttention(E, H, batch_first=True).eval()
    x, memory = torch.randn(3, 6, E), torch.randn(3, 4, E)
    index = torch.tensor([2, 0, 0, 1])  # beams: drop, repeat and permute rows

    def full(x: Tensor, memory: Tensor) -> Tensor:
        hidden, _ = decoder_self(x, x, x, is_causal=True, rotary=rope)
        return cross(hidden, memory, memory)[0]

    self_cache, cross_cache = KVCache(), KVCache(static=True)
    outputs = []
    for t in range(6):
        if t == 3:
            self_cache.reorder(index)
            cross_cache.reorder(index)
            x = x[index]
        step = x[:, t : t + 1]
        hidden, _ = decoder_self(step, step, step, is_causal=True, kv_cache=self_cache, rotary=rope)
        outputs.append(cross(hidden, memory, memory, kv_cache=cross_cache)[0])
    expected = full(x, memory[index])  # x already reordered: its first 3 rows' prefixes moved with the cache
    torch.testing.assert_close(torch.cat(outputs[3:], dim=1), expected[:, 3:], atol=1e-5, rtol=1e-5)
    assert self_cache.key.shape[0] == 4 and len(self_cache) == 6
    with pytest.raises(ValueError, match="KVCache holds batch size 4"):
        decoder_self(x[:2, :1], x[:2, :1], x[:2, :1], kv_cache=self_cache)
    step = x[:, :1]
    with pytest.raises(ValueError, match=r"\(4, 7\), got \(4, 6\)"):  # S counts the cached positions
        decoder_self(
            step, step, step, kv_cache=self_cache, key_padding_mask=torch.zeros(4, 6, dtype=torch.bool)
        )
    assert len(self_cache) == 6  # a rejected call leaves the cache as it was


def test_cache_grows_in_blocks_and_keeps_autograd() -> None:
    module = MultiHeadAttention(E, H, batch_first=True).eval()
    x = torch.randn(2, KVCache.BLOCK + 3, E)
    full, _ = module(x, x, x, is_causal=True, need_weights=False)
    cache = KVCache()
    with torch.no_grad():  # in-place appends into buffers of BLOCK positions
        steps = [module(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], kv_cache=cache)[0]
                 for t in range(x.size(1))]  # fmt: skip
        assert cache._key is not None and cache._key.shape[0] == 2 * KVCache.BLOCK  # position-major
        assert cache.key is not None and cache.value is not None
        before_key, before_value = cache.key.clone(), cache.value.clone()  # longer than one block
        index = torch.tensor([1, 1, 0])
        cache.reorder(index)
        assert len(cache) == x.size(1) and cache.key.shape[0] == 3
        # every position of every kept row is the row it was selected from, across the block boundary
        assert torch.equal(cache.key, before_key[index]) and torch.equal(cache.value, before_value[index])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    # with gradients the cache concatenates, so backward through cached steps works
    grad_cache, y = KVCache(), x.clone().requires_grad_()
    outs = [
        module(y[:, t : t + 1], y[:, t : t + 1], y[:, t : t + 1], kv_cache=grad_cache)[0] for t in range(3)
    ]
    torch.cat(outs, dim=1).sum().backward()
    assert y.grad is not None and torch.all(y.grad[:, 3:] == 0) and y.grad[:, :3].abs().sum() > 0


def test_cache_capacity_doubles_and_a_grow_keeps_every_cached_position() -> None:
    """One position at a time, the buffer is reallocated O(log n) times (its capacity at least doubles),
    and growing keeps what it held: one cached position, then a chunk longer than a block."""
    module = MultiHeadAttention(E, H, batch_first=True).eval()
    n = 6 * KVCache.BLOCK + 1
    x = torch.randn(2, n, E)
    cache, capacities = KVCache(), []
    with torch.no_grad():
        for t in range(n):
            module(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], kv_cache=cache)
            capacities.append(cache._key.shape[0])
    block = KVCache.BLOCK  # a block at a time would be 1, 2, 3, ..., 7 blocks
    assert sorted(set(capacities)) == [block, 2 * block, 4 * block, 8 * block]
    full, _ = module(x, x, x, is_causal=True, need_weights=False)
    cache = KVCache()
    with torch.no_grad():
        first, _ = module(x[:, :1], x[:, :1], x[:, :1], kv_cache=cache)
        span = slice(1, KVCache.BLOCK + 5)  # past the first block: a grow with one position held
        rest, _ = module(x[:, span], x[:, span], x[:, span], kv_cache=cache, is_causal=True)
    torch.testing.assert_close(
        torch.cat([first, rest], dim=1), full[:, : KVCache.BLOCK + 5], atol=1e-5, rtol=1e-5
    )
