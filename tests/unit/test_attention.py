"""MultiHeadAttention: drop-in equivalence with nn.MultiheadAttention, masks, KV cache, rotary, autocast."""

from __future__ import annotations

import functools
import itertools
import math
import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import transformer.attention as attention
import transformer.kernels as kernels
from transformer import KVCache, MultiHeadAttention, make_causal_mask

E, H = 8, 2  # tiny: the suite runs thousands of forward passes
KDIM, VDIM = 6, 10
# torch warns when key_padding_mask and attn_mask have different dtypes; mixing them is tested on purpose
pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched"),
    pytest.mark.usefixtures("one_thread"),
]


def _pair(seed: int = 0, embed_dim: int = E, num_heads: int = H, **kwargs) -> tuple[nn.Module, nn.Module]:
    """(ours, torch's) with identical weights: same seed and the state_dict loaded both ways."""
    torch.manual_seed(seed)
    ours = MultiHeadAttention(embed_dim, num_heads, **kwargs)
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(embed_dim, num_heads, **kwargs)
    # same registration order and init as torch: the seed alone gives the same weights
    for (name_a, a), (name_b, b) in zip(ours.state_dict().items(), ref.state_dict().items(), strict=True):
        assert name_a == name_b and torch.equal(a, b), name_a
    with torch.no_grad():  # non-zero biases, so a wrong bias slice cannot hide
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ref.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def _bool_mask(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    mask = torch.rand(shape, generator=gen) < 0.35
    mask[..., 0] = False  # every query keeps a key: torch's module gives NaN for fully masked rows
    return mask


def _float_mask(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    mask = 0.5 * torch.randn(shape, generator=gen)
    return mask.masked_fill(_bool_mask(shape, gen), -math.inf)


def _make_masks(
    attn_kind: str | None,
    kpm_kind: str | None,
    batch: int,
    q_len: int,
    k_len: int,
    unbatched: bool,
    gen: torch.Generator,
    heads: int = H,
) -> tuple[Tensor | None, Tensor | None]:
    attn_mask = kpm = None
    if attn_kind is not None:
        dtype, dims = attn_kind[:-2], attn_kind[-2:]
        lead = () if dims == "2d" else ((heads,) if unbatched else (batch * heads,))
        make = _bool_mask if dtype == "bool" else _float_mask
        attn_mask = make((*lead, q_len, k_len), gen)
    if kpm_kind is not None:
        make = _bool_mask if kpm_kind == "bool" else _float_mask
        kpm = make((k_len,) if unbatched else (batch, k_len), gen)
    return attn_mask, kpm


def _make_inputs(
    kind: str,
    batch: int,
    q_len: int,
    k_len: int,
    batch_first: bool,
    unbatched: bool,
    kdim: int,
    vdim: int,
    gen: torch.Generator,
    embed_dim: int = E,
) -> tuple[Tensor, Tensor, Tensor]:
    def make(length: int, dim: int) -> Tensor:
        if unbatched:
            return torch.randn(length, dim, generator=gen)
        shape = (batch, length, dim) if batch_first else (length, batch, dim)
        return torch.randn(shape, generator=gen)

    if kind == "self":  # query is key is value: the packed one-matmul path of both modules
        x = make(q_len, embed_dim)
        return x, x, x
    query = make(q_len, embed_dim)
    if kind == "cross_kv":  # key is value: one fused k/v matmul
        memory = make(k_len, kdim)
        return query, memory, memory
    return query, make(k_len, kdim), make(k_len, vdim)


def _assert_same(ours_out: tuple, ref_out: tuple, need_weights: bool, msg: str = "") -> None:
    torch.testing.assert_close(ours_out[0], ref_out[0], atol=1e-5, rtol=1e-5, msg=lambda m: f"{msg}\n{m}")
    if need_weights:
        torch.testing.assert_close(ours_out[1], ref_out[1], atol=1e-5, rtol=1e-5, msg=lambda m: f"{msg}\n{m}")
    else:
        assert ours_out[1] is None and ref_out[1] is None


# ---------------------------------------------------------------------------------------------------
# drop-in contract: constructor, state_dict, exhaustive and randomized equivalence
# ---------------------------------------------------------------------------------------------------

CONFIGS = list(itertools.product([True, False], [False, True], [False, True], [False, True], [True, False]))
CONFIG_IDS = [
    f"bias{int(b)}-biaskv{int(kv)}-zero{int(z)}-kdim{int(d)}-bf{int(bf)}" for b, kv, z, d, bf in CONFIGS
]
ATTN_KINDS = [None, "bool2d", "float2d", "bool3d", "float3d"]
KPM_KINDS = [None, "bool", "float"]
WEIGHT_MODES = [(False, True), (True, True), (True, False)]  # (need_weights, average_attn_weights)


def _config_kwargs(bias: bool, bias_kv: bool, zero: bool, kdim: bool, batch_first: bool) -> dict:
    kwargs = {"bias": bias, "add_bias_kv": bias_kv, "add_zero_attn": zero, "batch_first": batch_first}
    if kdim:
        kwargs |= {"kdim": KDIM, "vdim": VDIM}
    return kwargs


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_state_dict_matches_torch(config: tuple) -> None:
    ours, ref = _pair(**_config_kwargs(*config))
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in ref.state_dict().items()
    ]
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_matches_torch_exhaustive(config: tuple) -> None:
    """Every input layout x mask kind x weights option, for one module configuration.

    Train (dropout 0) and eval alternate so that each mask combination meets both modes, once
    batched and once unbatched; the randomized and causal tests cross the modes with the rest.
    """
    kwargs = _config_kwargs(*config)
    ours, ref = _pair(**kwargs)
    gen = torch.Generator().manual_seed(1)
    batch, q_len, k_len = 2, 3, 4
    kinds = ["cross"] if "kdim" in kwargs else ["self", "cross_kv", "cross"]
    kdim, vdim = kwargs.get("kdim", E), kwargs.get("vdim", E)
    for unbatched, kind in itertools.product([False, True], kinds):
        k_len_ = q_len if kind == "self" else k_len
        query, key, value = _make_inputs(kind, batch, q_len, k_len_, config[-1], unbatched, kdim, vdim, gen)
        for (i, attn_kind), (j, kpm_kind) in itertools.product(enumerate(ATTN_KINDS), enumerate(KPM_KINDS)):
            train = (i + j + unbatched) % 2 == 0
            ours.train(train)
            ref.train(train)
            attn_mask, kpm = _make_masks(attn_kind, kpm_kind, batch, q_len, k_len_, unbatched, gen)
            for need_weights, average in WEIGHT_MODES:
                call = {
                    "key_padding_mask": kpm,
                    "attn_mask": attn_mask,
                    "need_weights": need_weights,
                    "average_attn_weights": average,
                }
                msg = f"{kind} unbatched={unbatched} train={train} attn={attn_kind} kpm={kpm_kind}"
                msg += f" need_weights={need_weights} average={average}"
                _assert_same(
                    ours(query, key, value, **call), ref(query, key, value, **call), need_weights, msg
                )


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_matches_torch_causal(config: tuple) -> None:
    """is_causal: torch's module needs the causal attn_mask with the hint; ours also builds it itself."""
    kwargs = _config_kwargs(*config)
    ours, ref = _pair(**kwargs)
    gen = torch.Generator().manual_seed(2)
    batch, length = 2, 4
    kdim, vdim = kwargs.get("kdim", E), kwargs.get("vdim", E)
    kind = "cross" if "kdim" in kwargs else "self"
    causal = make_causal_mask(length)
    n_extra = int(config[1]) + int(config[2])
    for unbatched, kpm_kind, (need_weights, average), train in itertools.product(
        [False, True], KPM_KINDS, WEIGHT_MODES, [True, False]
    ):
        ours.train(train)
        ref.train(train)
        query, key, value = _make_inputs(kind, batch, length, length, config[-1], unbatched, kdim, vdim, gen)
        _, kpm = _make_masks(None, kpm_kind, batch, length, length, unbatched, gen)
        call = {"key_padding_mask": kpm, "need_weights": need_weights, "average_attn_weights": average}
        # With bias_k / zero attention, no padding mask and need_weights=False, torch's module hands the
        # hint to SDPA, whose top-left causal mask also hides the extra key columns, unlike its own
        # need_weights=True path. Ours always attends to those columns, i.e. the explicit-mask result.
        torch_trusts_hint = n_extra == 0 or kpm is not None or need_weights
        expected = ref(query, key, value, attn_mask=causal, is_causal=torch_trusts_hint, **call)
        msg = f"unbatched={unbatched} kpm={kpm_kind} train={train} weights={need_weights, average}"
        _assert_same(ours(query, key, value, is_causal=True, **call), expected, need_weights, msg)
        _assert_same(
            ours(query, key, value, attn_mask=causal, is_causal=True, **call), expected, need_weights, msg
        )


def _random_case(rng: random.Random) -> dict:
    heads = rng.choice([1, 2, 4])
    embed_dim = heads * rng.choice([2, 4, 6])
    separate = rng.random() < 0.25
    kwargs = {
        "bias": rng.random() < 0.7,
        "add_bias_kv": rng.random() < 0.3,
        "add_zero_attn": rng.random() < 0.3,
        "batch_first": rng.random() < 0.5,
    }
    if separate:
        kwargs |= {"kdim": rng.choice([3, 5]), "vdim": rng.choice([4, 7])}
    kind = "cross" if separate else rng.choice(["self", "cross_kv", "cross"])
    q_len = rng.randint(1, 6)
    is_causal = kind == "self" and rng.random() < 0.3
    return {
        "heads": heads,
        "embed_dim": embed_dim,
        "kwargs": kwargs,
        "kind": kind,
        "batch": rng.randint(1, 3),
        "q_len": q_len,
        "k_len": q_len if kind == "self" else rng.randint(1, 7),
        "unbatched": rng.random() < 0.2,
        "attn_kind": rng.choice(ATTN_KINDS),
        "kpm_kind": rng.choice(KPM_KINDS),
        "weights": rng.choice(WEIGHT_MODES),
        "train": rng.random() < 0.5,
        "is_causal": is_causal,
    }


@pytest.mark.parametrize("seed", range(4))
def test_matches_torch_randomized_with_gradients(seed: int) -> None:
    """Random sizes and options; outputs, weights and every gradient (inputs and parameters) match."""
    rng = random.Random(seed)
    for case_index in range(40):
        case = _random_case(rng)
        embed_dim, heads = case["embed_dim"], case["heads"]
        ours, ref = _pair(seed=case_index, embed_dim=embed_dim, num_heads=heads, **case["kwargs"])
        ours.train(case["train"])
        ref.train(case["train"])
        gen = torch.Generator().manual_seed(case_index)
        kdim, vdim = case["kwargs"].get("kdim", embed_dim), case["kwargs"].get("vdim", embed_dim)
        bf = case["kwargs"]["batch_first"]
        shape = (case["batch"], case["q_len"], case["k_len"])
        inputs = _make_inputs(case["kind"], *shape, bf, case["unbatched"], kdim, vdim, gen, embed_dim)
        attn_mask, kpm = _make_masks(
            case["attn_kind"], case["kpm_kind"], *shape, case["unbatched"], gen, heads
        )
        if case["is_causal"]:
            attn_mask = make_causal_mask(case["q_len"])
        need_weights, average = case["weights"]
        call = {
            "key_padding_mask": kpm,
            "attn_mask": attn_mask,
            "need_weights": need_weights,
            "average_attn_weights": average,
        }
        n_extra = int(case["kwargs"]["add_bias_kv"]) + int(case["kwargs"]["add_zero_attn"])
        hint_safe = n_extra == 0 or kpm is not None or need_weights  # see test_matches_torch_causal
        results = []
        for module, is_causal in ((ours, case["is_causal"]), (ref, case["is_causal"] and hint_safe)):
            leaves = {}
            for tensor in inputs:
                leaves.setdefault(id(tensor), tensor.clone().requires_grad_(True))
            q, k, v = (leaves[id(t)] for t in inputs)  # keeps `query is key is value` where it held
            out, weights = module(q, k, v, is_causal=is_causal, **call)
            loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
            if weights is not None:
                loss = loss + (weights * torch.linspace(1, 2, weights.numel()).view_as(weights)).sum()
            loss.backward()
            grads = {n: p.grad for n, p in module.named_parameters()}
            grads |= {f"input{i}": t.grad for i, t in enumerate(leaves.values())}
            results.append((out, weights, grads))
        msg = f"seed {seed} case {case_index}: {case}"
        _assert_same(results[0][:2], results[1][:2], need_weights, msg)
        assert results[0][2].keys() == results[1][2].keys()
        for name, grad in results[0][2].items():
            torch.testing.assert_close(grad, results[1][2][name], atol=1e-5, rtol=1e-4, msg=f"{name} {msg}")


def test_matches_torch_inference_fast_path() -> None:
    """Under no_grad in eval mode torch's module takes its fused native path; still the same numbers."""
    ours, ref = _pair(batch_first=True)
    ours.eval()
    ref.eval()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, E, generator=gen)
    kpm = _bool_mask((3, 5), gen)
    with torch.no_grad():
        for call in ({}, {"key_padding_mask": kpm}, {"attn_mask": _bool_mask((5, 5), gen)}):
            for need_weights in (False, True):
                _assert_same(
                    ours(x, x, x, need_weights=need_weights, **call),
                    ref(x, x, x, need_weights=need_weights, **call),
                    need_weights,
                )


# ---------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------


def test_embed_dim_not_divisible_names_both() -> None:
    with pytest.raises(ValueError, match=r"embed_dim \(10\).*num_heads \(4\)"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match="positive"):
        MultiHeadAttention(0, 1)
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadAttention(8, 2, dropout=1.5)


@pytest.mark.parametrize(
    ("name", "mask", "expected"),
    [
        ("key_padding_mask", torch.zeros(2, 4, dtype=torch.bool), r"\(2, 5\), got \(2, 4\)"),
        ("key_padding_mask", torch.zeros(3, 5, dtype=torch.bool), r"\(2, 5\), got \(3, 5\)"),
        ("key_padding_mask", torch.zeros(2, 5, 1), r"\(2, 5\), got \(2, 5, 1\)"),
        ("attn_mask", torch.zeros(3, 4, dtype=torch.bool), r"\(3, 5\) or .*\(4, 3, 5\), got \(3, 4\)"),
        ("attn_mask", torch.zeros(2, 3, 5), r"\(3, 5\) or .*\(4, 3, 5\), got \(2, 3, 5\)"),
        ("attn_mask", torch.zeros(1, 1, 3, 5), r"got \(1, 1, 3, 5\)"),
        ("attn_mask", torch.zeros(3, 5, dtype=torch.long), "bool or floating point"),
    ],
)
def test_wrong_mask_raises_value_error_with_shapes(name: str, mask: Tensor, expected: str) -> None:
    module = MultiHeadAttention(E, H, batch_first=True)
    query, memory = torch.randn(2, 3, E), torch.randn(2, 5, E)
    with pytest.raises(ValueError, match=expected):
        module(query, memory, memory, **{name: mask})


def test_wrong_inputs_raise_value_error() -> None:
    module = MultiHeadAttention(E, H, batch_first=True)
    x = torch.randn(2, 3, E)
    with pytest.raises(ValueError, match="embed_dim=8"):
        module(torch.randn(2, 3, E + 1), x, x)
    with pytest.raises(ValueError, match="same number of dims"):
        module(x, x[0], x[0])
    with pytest.raises(ValueError, match="batch sizes differ"):
        module(x, x[:1], x[:1])
    with pytest.raises(ValueError, match=r"\(S,\)"):
        module(x[0], x[0], x[0], key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key and value are required"):
        module(x, None, None)


# ---------------------------------------------------------------------------------------------------
# behaviour beyond the torch module
# ---------------------------------------------------------------------------------------------------


def test_sdpa_on_cpu_returns_zeros_for_fully_masked_rows() -> None:
    """The assumption behind `_SDPA_ZEROES_EMPTY_ROWS`: checked on the installed torch."""
    q = torch.randn(2, 2, 3, 4, requires_grad=True)
    k, v = (torch.randn(2, 2, 4, 4, requires_grad=True) for _ in range(2))
    attend = torch.ones(2, 1, 3, 4, dtype=torch.bool)
    attend[0, :, 1] = False
    out = F.scaled_dot_product_attention(q, k, v, attend)
    assert torch.equal(out[0, :, 1], torch.zeros(2, 4))
    out.sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))


@pytest.mark.parametrize("sdpa_zeroes_rows", [True, False], ids=["cpu-kernel", "manual-fixup"])
@pytest.mark.parametrize("mask_kind", ["kpm_bool", "kpm_float", "attn_bool", "attn_float3d", "both"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_rows_give_zeros_and_finite_grads(
    sdpa_zeroes_rows: bool, mask_kind: str, need_weights: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not sdpa_zeroes_rows:  # exercise the fix-up used on devices whose kernels return NaN
        monkeypatch.setattr(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset())
    ours, ref = _pair(batch_first=True)
    batch, q_len, k_len = 3, 4, 5
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(batch, q_len, E, generator=gen, requires_grad=True)
    memory = torch.randn(batch, k_len, E, generator=gen, requires_grad=True)
    kpm = torch.zeros(batch, k_len, dtype=torch.bool)
    kpm[1] = True  # every key of sentence 1 is padding: all its query rows are empty
    attn = torch.zeros(q_len, k_len, dtype=torch.bool)
    attn[2] = True  # query 2 may attend to nothing
    empty = torch.zeros(batch, q_len, dtype=torch.bool)
    call: dict = {}
    if mask_kind.startswith("kpm"):
        call["key_padding_mask"] = (
            kpm if mask_kind == "kpm_bool" else torch.zeros(kpm.shape).masked_fill(kpm, -math.inf)
        )
        empty[1] = True
    elif mask_kind == "attn_bool":
        call["attn_mask"] = attn
        empty[:, 2] = True
    elif mask_kind == "attn_float3d":
        per_head = torch.zeros(batch * H, q_len, k_len).masked_fill(attn, -math.inf)
        call["attn_mask"] = per_head
        empty[:, 2] = True
    else:
        call |= {"key_padding_mask": kpm, "attn_mask": attn}
        empty[1] = True
        empty[:, 2] = True

    out, weights = ours(query, memory, memory, need_weights=need_weights, average_attn_weights=False, **call)
    assert out.isfinite().all()
    # zero attention output: only the output projection's bias is left
    torch.testing.assert_close(out[empty], ours.out_proj.bias.expand(int(empty.sum()), E))
    if need_weights:
        assert torch.equal(weights.transpose(1, 2)[empty], torch.zeros(int(empty.sum()), H, k_len))
    # rows that do attend somewhere still match torch's module (which gives NaN in the empty ones)
    expected, _ = ref(query, memory, memory, need_weights=need_weights, **call)
    torch.testing.assert_close(out[~empty], expected[~empty], atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    for tensor in (query, memory, *ours.parameters()):
        assert tensor.grad.isfinite().all()
    assert torch.equal(query.grad[empty], torch.zeros(int(empty.sum()), E))


def test_weights_rows_sum_to_one_and_masked_keys_get_exactly_zero() -> None:
    module = MultiHeadAttention(E, H, batch_first=True)
    gen = torch.Generator().manual_seed(5)
    query, memory = torch.randn(2, 4, E, generator=gen), torch.randn(2, 6, E, generator=gen)
    kpm = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    attn = _bool_mask((4, 6), gen)
    float_kpm = torch.zeros(2, 6).masked_fill(kpm, -math.inf)
    for call in ({"key_padding_mask": kpm, "attn_mask": attn}, {"key_padding_mask": float_kpm}):
        _, weights = module(query, memory, memory, average_attn_weights=False, **call)  # (B, H, T, S)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, H, 4))
        masked = kpm[:, None, None, :].expand_as(weights)
        if "attn_mask" in call:
            masked = masked | attn
        assert (weights[masked] == 0).all()
        assert (weights[~masked] > 0).all()
        _, averaged = module(query, memory, memory, **call)
        torch.testing.assert_close(averaged, weights.mean(1))


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("how", ["is_causal", "mask", "mask+hint"])
def test_causal_output_ignores_later_positions(need_weights: bool, how: str) -> None:
    module = MultiHeadAttention(E, H, batch_first=True)
    call = {
        "is_causal": {"is_causal": True},
        "mask": {"attn_mask": make_causal_mask(6)},
        "mask+hint": {"attn_mask": make_causal_mask(6), "is_causal": True},
    }[how]
    x = torch.randn(2, 6, E)
    out, _ = module(x, x, x, need_weights=need_weights, **call)
    for i in range(5):
        changed = x.clone()
        changed[:, i + 1 :] = torch.randn(2, 5 - i, E)
        out_changed, _ = module(changed, changed, changed, need_weights=need_weights, **call)
        torch.testing.assert_close(out_changed[:, : i + 1], out[:, : i + 1], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(out_changed[:, i + 1 :], out[:, i + 1 :])


def test_make_causal_mask() -> None:
    assert torch.equal(make_causal_mask(3), torch.tensor([[0, 1, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.bool))
    # queries aligned with the last keys (new positions after a cache)
    expected = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(make_causal_mask(2, num_keys=4), expected)


def _reference_attention(module: MultiHeadAttention, query: Tensor, memory: Tensor, scale: float) -> Tensor:
    """softmax(Q K^T * scale) V per head, merged and projected, written out plainly."""
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    batch, q_len, _ = query.shape
    heads, d_head = module.num_heads, module.head_dim

    def split(x: Tensor) -> Tensor:
        return x.view(batch, -1, heads, d_head).transpose(1, 2)  # (B, H, L, Dh)

    q, k, v = split(query @ w_q.T + b_q), split(memory @ w_k.T + b_k), split(memory @ w_v.T + b_v)
    weights = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)  # (B, H, T, S)
    merged = (weights @ v).transpose(1, 2).reshape(batch, q_len, heads * d_head)
    return merged @ module.out_proj.weight.T + module.out_proj.bias


def test_scaling_uses_head_dim() -> None:
    module = MultiHeadAttention(12, 3, batch_first=True)  # Dh = 4, so 1/sqrt(Dh) != 1/sqrt(D)
    with torch.no_grad():
        module.in_proj_weight.mul_(3.0)  # peaky scores, so the scale matters
    query, memory = torch.randn(2, 3, 12), torch.randn(2, 5, 12)
    expected = _reference_attention(module, query, memory, 1 / math.sqrt(4))
    wrong = _reference_attention(module, query, memory, 1 / math.sqrt(12))
    for need_weights in (False, True):
        out, _ = module(query, memory, memory, need_weights=need_weights)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out, wrong, atol=1e-3)


def test_attention_dropout_only_in_training() -> None:
    module = MultiHeadAttention(E, H, dropout=0.5, batch_first=True)
    plain = MultiHeadAttention(E, H, batch_first=True)
    plain.load_state_dict(module.state_dict())
    x = torch.randn(2, 5, E)
    module.eval()
    for need_weights in (False, True):
        torch.testing.assert_close(module(x, x, x, need_weights=need_weights)[0], plain(x, x, x)[0])
    module.train()
    for need_weights in (False, True):
        first, weights = module(x, x, x, need_weights=need_weights, average_attn_weights=False)
        second, _ = module(x, x, x, need_weights=need_weights)
        assert not torch.allclose(first, second)
    assert (weights == 0).any() and not torch.allclose(weights.sum(-1), torch.ones(2, H, 5))


def test_attention_dropout_drops_weights_with_its_probability_and_rescales_the_rest() -> None:
    """The returned weights in training (as torch's, after dropout): each one zero with probability p, the
    others the eval weights / (1 - p); the output is those weights times V."""
    torch.manual_seed(0)
    module = MultiHeadAttention(E, H, dropout=0.3, batch_first=True)
    x = torch.randn(8, 12, E)
    module.eval()
    _, expected = module(x, x, x, need_weights=True, average_attn_weights=False)  # (8, H, 12, 12)
    module.train()
    _, weights = module(x, x, x, need_weights=True, average_attn_weights=False)
    dropped = weights == 0
    assert abs(dropped.float().mean().item() - 0.3) < 0.03  # 4,608 weights
    torch.testing.assert_close(weights[~dropped], expected[~dropped] / 0.7)


def test_fast_path_gets_minimal_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """No mask when none is given, SDPA's is_causal for a plain causal mask, (B, 1, 1, S) for padding."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        seen.append((None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype), is_causal))
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    module = MultiHeadAttention(E, H, batch_first=True)
    x = torch.randn(2, 5, E)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    module(x, x, x, need_weights=False)
    module(x, x, x, need_weights=False, is_causal=True)
    module(x, x, x, need_weights=False, key_padding_mask=kpm)
    assert seen == [(None, False), (None, True), (((2, 1, 1, 5), torch.bool), False)]


def test_projections_are_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """One in-projection matmul for self-attention, two for cross-attention with key is value."""
    calls = []
    linear = F.linear

    def spy(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    module = MultiHeadAttention(E, H, batch_first=True)
    x, memory = torch.randn(2, 3, E), torch.randn(2, 4, E)
    module(x, x, x)
    assert calls == [(3 * E, E), (E, E)]  # in_proj, out_proj
    calls.clear()
    module(x, memory, memory)
    assert calls == [(E, E), (2 * E, E), (E, E)]  # q, fused k/v, out_proj


# ---------------------------------------------------------------------------------------------------
# incremental decoding: KV cache and rotary hook
# ---------------------------------------------------------------------------------------------------


def _rope(x: Tensor, offset: int) -> Tensor:
    """A plain rotary embedding (Su et al., 2021) of (B, H, L, Dh) at positions offset .. offset + L - 1."""
    half = x.shape[-1] // 2
    positions = torch.arange(offset, offset + x.shape[-2], dtype=x.dtype)
    angles = positions[:, None] * 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half)  # (L, Dh/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


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
        return _rope(t, offset)

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
        module(x, x, x, kv_cache=KVCache(static=True), rotary=_rope)


def test_cache_reorder_for_beams() -> None:
    decoder_self = MultiHeadAttention(E, H, batch_first=True).eval()
    cross = MultiHeadAttention(E, H, batch_first=True).eval()
    x, memory = torch.randn(3, 6, E), torch.randn(3, 4, E)
    index = torch.tensor([2, 0, 0, 1])  # beams: drop, repeat and permute rows

    def full(x: Tensor, memory: Tensor) -> Tensor:
        hidden, _ = decoder_self(x, x, x, is_causal=True, rotary=_rope)
        return cross(hidden, memory, memory)[0]

    self_cache, cross_cache = KVCache(), KVCache(static=True)
    outputs = []
    for t in range(6):
        if t == 3:
            self_cache.reorder(index)
            cross_cache.reorder(index)
            x = x[index]
        step = x[:, t : t + 1]
        hidden, _ = decoder_self(step, step, step, is_causal=True, kv_cache=self_cache, rotary=_rope)
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


# ---------------------------------------------------------------------------------------------------
# reduced precision
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("need_weights", [False, True])
def test_autocast_close_to_fp32(dtype: torch.dtype, need_weights: bool) -> None:
    module = MultiHeadAttention(16, 2, batch_first=True, add_bias_kv=False)
    x, memory = torch.randn(2, 4, 16), torch.randn(2, 5, 16)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0, 3:] = True
    float_mask = torch.zeros(4, 5).masked_fill(make_causal_mask(4, num_keys=5), -math.inf)
    for call in (
        {"key_padding_mask": kpm},
        {"attn_mask": float_mask, "key_padding_mask": kpm},
        {"is_causal": True},
    ):
        keys = x if call.get("is_causal") else memory
        expected, _ = module(x, keys, keys, need_weights=need_weights, **call)
        with torch.autocast("cpu", dtype=dtype):
            out, weights = module(x, keys, keys, need_weights=need_weights, **call)
        assert out.dtype == dtype and out.isfinite().all()
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
        if need_weights:
            assert weights.isfinite().all()
    # a fully padded sentence stays finite (zeros) in low precision too
    kpm[1] = True
    with torch.autocast("cpu", dtype=dtype):
        out, _ = module(x, memory, memory, key_padding_mask=kpm, need_weights=need_weights)
    assert out.isfinite().all()


@pytest.mark.gpu
def test_cuda_fully_masked_rows_and_fp16() -> None:
    module = MultiHeadAttention(64, 4, batch_first=True).cuda().half()
    x = torch.randn(3, 9, 64, device="cuda", dtype=torch.half, requires_grad=True)
    kpm = torch.zeros(3, 9, dtype=torch.bool, device="cuda")
    kpm[1] = True
    for need_weights in (False, True):
        out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        assert out.isfinite().all()
        torch.testing.assert_close(out[1], module.out_proj.bias.expand(9, 64))
        out.float().sum().backward()
        assert x.grad.isfinite().all()


# ---------------------------------------------------------------------------------------------------
# packed tokens (unpadding) and the growing KV cache
# ---------------------------------------------------------------------------------------------------


def test_token_packing_round_trip() -> None:
    keep = torch.tensor([[True, True, False], [False, True, True]])
    packing = attention.TokenPacking(keep)
    x = torch.randn(2, 3, 4)
    assert len(packing) == 4 and packing.positions.tolist() == [0, 1, 1, 2]
    torch.testing.assert_close(packing.pack(x), x[keep])
    back = packing.unpack(packing.pack(x))
    torch.testing.assert_close(back[keep], x[keep])
    assert torch.all(back[~keep] == 0)


@pytest.mark.parametrize("use_rotary", [False, True])
def test_forward_packed_matches_padded_forward_with_gradients(use_rotary: bool) -> None:
    """Self (causal or padded) and cross attention on packed tokens = the padded path at kept positions."""
    module = MultiHeadAttention(E, H, batch_first=True)
    x, memory = torch.randn(3, 5, E), torch.randn(3, 6, E)
    x_keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    m_pad = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    x_packing, m_packing = attention.TokenPacking(x_keep), attention.TokenPacking(~m_pad)
    hook = _rope if use_rotary else None
    cases = [
        (lambda q: module(q, q, q, is_causal=True, need_weights=False, rotary=hook)[0],
         lambda q: module.forward_packed(q, q, x_packing, x_packing, is_causal=True, rotary=hook)),
        (lambda q: module(q, q, q, key_padding_mask=~x_keep, need_weights=False, rotary=hook)[0],
         lambda q: module.forward_packed(q, q, x_packing, x_packing, ~x_keep, rotary=hook)),
        (lambda q: module(q, memory, memory, key_padding_mask=m_pad, need_weights=False)[0],
         lambda q: module.forward_packed(q, m_packing.pack(memory), x_packing, m_packing, m_pad)),
    ]  # fmt: skip
    for padded, packed in cases:
        q = x.clone().requires_grad_()
        expected = padded(q)[x_keep]
        expected.sum().backward()
        expected_grad, q.grad = q.grad[x_keep], None
        got = packed(x_packing.pack(q))
        got.sum().backward()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q.grad[x_keep], expected_grad, atol=1e-5, rtol=1e-5)


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


# ---------------------------------------------------------------------------------------------------
# fully masked rows: which SDPA kernels zero them, and the fix-up for those that may not
# ---------------------------------------------------------------------------------------------------


def _empty_row_inputs(device: str, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v (2, 2, 3, 8) and a boolean SDPA mask (True = attend) whose query row 1 of batch 0 is empty."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 8, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    attend = torch.ones(2, 1, 3, 3, dtype=torch.bool, device=device)
    attend[0, :, 1] = False
    attend[1, :, 2, 0] = False
    return q, k, v, attend


def _runs(backend: SDPBackend, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> bool:
    """Whether SDPA runs `backend` for these inputs when it is the only one allowed."""
    with sdpa_kernel([backend]):
        try:
            return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, False)) == backend
        except RuntimeError:  # "No viable backend"
            return False


def _assert_zero_rows_and_finite_grads(out: Tensor, q: Tensor, k: Tensor, v: Tensor) -> None:
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert out.isfinite().all()
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in (q, k, v))
    assert torch.equal(q.grad[0, :, 1], torch.zeros_like(q.grad[0, :, 1]))


@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("backend", sorted(kernels._ZEROING_BACKENDS, key=int), ids=lambda b: b.name)
def test_zeroing_backends_zero_fully_masked_rows_on_cpu(backend: SDPBackend, float_mask: bool) -> None:
    """The claim behind `_ZEROING_BACKENDS`, for the backends the CPU has (math, flash)."""
    q, k, v, attend = _empty_row_inputs("cpu", torch.float32)
    mask = torch.zeros(attend.shape).masked_fill(~attend, -math.inf) if float_mask else attend
    if not _runs(backend, q, k, v, mask):
        pytest.skip(f"{backend.name} does not run on the CPU")
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, mask)
    _assert_zero_rows_and_finite_grads(out, q, k, v)


@pytest.mark.parametrize("float_mask", [False, True])
def test_the_fix_up_zeroes_rows_for_kernels_that_may_not(
    float_mask: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch would pick a kernel outside `_ZEROING_BACKENDS` (cuDNN's), `attend` fixes the rows up: the
    same numbers elsewhere, zeros and zero gradients in the empty row."""
    q, k, v, attend = _empty_row_inputs("cpu", torch.float32)
    kpm = ~attend[:, 0, 0]  # (B, S) torch polarity; row 1 of batch 0 comes from attn_mask below
    attn = torch.zeros(3, 3, dtype=torch.bool)
    attn[1] = True  # query 1 attends to nothing
    kwargs = {"is_causal": False, "need_weights": False}
    if float_mask:
        attn = torch.zeros(3, 3).masked_fill(attn, -math.inf)
    expected, _ = kernels.attend(q, k, v, attn, kpm, **kwargs)
    monkeypatch.setattr(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset())
    monkeypatch.setattr(kernels, "_sdpa_backend", lambda *args: SDPBackend.CUDNN_ATTENTION)
    calls: list[Tensor] = []
    original = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[3]) or original(*a, **kw)
    )
    out, _ = kernels.attend(q, k, v, attn, kpm, **kwargs)
    # the kernel saw no empty row: the fix-up ran
    assert (calls[0] if calls[0].dtype == torch.bool else calls[0] > -math.inf).any(dim=-1).all()
    torch.testing.assert_close(out, expected)
    q.grad = k.grad = v.grad = None
    _assert_zero_rows_and_finite_grads(out, q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "backend",
    [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
    ids=lambda b: b.name,
)
def test_cuda_backends_and_attend_on_fully_masked_rows(backend: SDPBackend) -> None:
    """On a GPU: every backend in `_ZEROING_BACKENDS` zeroes fully masked rows itself (else the claim is
    wrong: take it out of the set), and `attend` gives zeros whichever backends the caller enables (it
    leaves cuDNN's out on CUDA, `_WITHOUT_CUDNN_DEVICES`)."""
    q, k, v, attend = _empty_row_inputs("cuda", torch.bfloat16)
    if not _runs(backend, q, k, v, attend):
        pytest.skip(f"{backend.name} does not take these inputs here")
    with sdpa_kernel([backend]):
        if backend in kernels._ZEROING_BACKENDS:
            _assert_zero_rows_and_finite_grads(F.scaled_dot_product_attention(q, k, v, attend), q, k, v)
            q.grad = k.grad = v.grad = None
        out, _ = kernels.attend(q, k, v, None, ~attend[:, 0, 0], is_causal=False, need_weights=False)
        out2, _ = kernels.attend(q, k, v, ~attend[0, 0], None, is_causal=False, need_weights=False)
    assert out.isfinite().all()
    _assert_zero_rows_and_finite_grads(out2, q, k, v)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sdpa_runs_without_cudnn_on_the_listed_devices(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where `_WITHOUT_CUDNN_DEVICES` lists the device (CUDA; the CPU here): the kernel runs with cuDNN's
    backend off and the caller's setting back afterwards, no row fix-up is added even where torch's chooser
    would say cuDNN, the output is unchanged, and torch.compile traces it without a graph break."""
    from torch._dynamo.utils import counters

    q, k, v, attend = _empty_row_inputs("cpu", torch.float32)
    attn = ~attend[0, 0]  # (T, S), torch polarity: query 1 attends to nothing
    expected, _ = kernels.attend(q, k, v, attn, None, is_causal=False, need_weights=False)
    monkeypatch.setattr(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset())
    monkeypatch.setattr(kernels, "_sdpa_backend", lambda *args: SDPBackend.CUDNN_ATTENTION)
    monkeypatch.setattr(kernels, "_WITHOUT_CUDNN_DEVICES", frozenset({"cpu"}))
    seen: list[tuple[bool, Tensor]] = []
    original = F.scaled_dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> Tensor:
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), args[3]))
        return original(*args, **kwargs)

    call = functools.partial(kernels.attend, is_causal=False, need_weights=False)
    if compiled:
        torch._dynamo.reset()
        counters.clear()
        call = torch.compile(call, fullgraph=True, backend="eager")  # fullgraph: a break raises
    else:  # (the recording itself would break the graph)
        monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    out, _ = call(q, k, v, attn, None)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
    torch.testing.assert_close(out, expected)
    if not compiled:
        assert seen == [(False, seen[0][1])]
        assert not seen[0][1][1].any()  # the empty row reached the kernel as it is: no fix-up
    else:
        assert counters["graph_break"] == {}
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_additive_mask_gives_the_same_output_as_its_boolean_form(dtype: torch.dtype) -> None:
    """`kernels.additive_mask` is what SDPA makes of a boolean mask itself: the same bits out, for a
    padding mask and an attention mask, in float32 and bfloat16 (the decoding caches rely on it)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 4, 8, dtype=dtype) for _ in range(3))
    padding = torch.tensor([[False] * 4, [False, False, True, True], [False, True, True, True]])  # (B, S)
    causal = kernels.make_causal_mask(4)  # (T, S)
    for attn, pad in ((None, padding), (causal, None), (causal, padding)):
        expected, _ = kernels.attend(q, k, v, attn, pad, is_causal=False, need_weights=False)
        out, _ = kernels.attend(
            q,
            k,
            v,
            None if attn is None else kernels.additive_mask(attn, dtype),
            None if pad is None else kernels.additive_mask(pad, dtype),
            is_causal=False,
            need_weights=False,
        )
        assert torch.equal(out, expected)
    mask = kernels.additive_mask(padding, dtype)
    assert mask.dtype == dtype and torch.equal(mask.isneginf(), padding) and not mask[~padding].any()


def test_attention_dtype_follows_autocast() -> None:
    x = torch.zeros(2, 3)
    assert kernels.attention_dtype(x) == torch.float32
    assert kernels.attention_dtype(x.bfloat16()) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels.attention_dtype(x) == torch.bfloat16


def test_a_search_enters_the_backends_once_not_in_every_attention_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a `_WITHOUT_CUDNN_DEVICES` device (CUDA; the CPU here) a search enters `attention_backends` once
    around its loop; its attention calls, finding cuDNN's backend already off, do not enter it again (the
    context costs ~10-20 µs a call, more than a small kernel). A call outside a search still enters it."""
    from tests.helpers.tiny import tiny_seq2seq, tiny_sources
    from transformer.search.decoding import DecodingSettings, search

    monkeypatch.setattr(kernels, "_WITHOUT_CUDNN_DEVICES", frozenset({"cpu"}))
    entered: list[bool] = []
    original = kernels.sdpa_kernel

    def counted(*args: Any, **kwargs: Any) -> Any:
        entered.append(torch.backends.cuda.cudnn_sdp_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "sdpa_kernel", counted)
    cudnn_off: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> Tensor:
        cudnn_off.append(not torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = tiny_seq2seq(0, vocab=24)
    for beam_size in (1, 4):
        entered.clear()
        cudnn_off.clear()
        search(model, tiny_sources(4, vocab=24), DecodingSettings(beam_size=beam_size, max_len_b=6))
        assert entered == [True]  # once, by the search
        assert len(cudnn_off) > 10 and all(cudnn_off)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored
    entered.clear()
    q = torch.randn(1, 2, 3, 4)
    kernels.attend(q, q, q, None, torch.tensor([[False, False, True]]), is_causal=False, need_weights=False)
    assert entered == [True]


def test_under_autocast_the_chooser_is_not_trusted_with_other_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autocast casts SDPA's float32 inputs but not the chooser's: the fix-up runs whatever it says."""
    monkeypatch.setattr(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset())
    monkeypatch.setattr(kernels, "_sdpa_backend", lambda *args: SDPBackend.EFFICIENT_ATTENTION)
    q, k, v, attend = _empty_row_inputs("cpu", torch.float32)
    assert not kernels._kernel_leaves_empty_rows(q, k, v, attend, 0.0, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels._kernel_leaves_empty_rows(q, k, v, attend, 0.0, False)
        assert not kernels._kernel_leaves_empty_rows(q.bfloat16(), k, v, attend, 0.0, False)
