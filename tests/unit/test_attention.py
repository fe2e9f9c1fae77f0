"""MultiHeadAttention as a drop-in for nn.MultiheadAttention: the same state_dict, the same outputs,
weights and gradients over every constructor option, mask kind and weight mode (exhaustive, causal,
randomized, the inference fast path), and the same errors on bad input."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import Tensor

from tests.helpers.attention import E, H, bool_mask, pair_with_torch
from transformer import MultiHeadAttention, make_causal_mask

# torch warns when key_padding_mask and attn_mask have different dtypes; mixing them is tested on purpose
pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched"),
    pytest.mark.usefixtures("one_thread"),
]

KDIM, VDIM = 6, 10


def _float_mask(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    mask = 0.5 * torch.randn(shape, generator=gen)
    return mask.masked_fill(bool_mask(shape, gen), -math.inf)


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
        make = bool_mask if dtype == "bool" else _float_mask
        attn_mask = make((*lead, q_len, k_len), gen)
    if kpm_kind is not None:
        make = bool_mask if kpm_kind == "bool" else _float_mask
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
    ours, ref = pair_with_torch(**_config_kwargs(*config))
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
    ours, ref = pair_with_torch(**kwargs)
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
    ours, ref = pair_with_torch(**kwargs)
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
        ours, ref = pair_with_torch(seed=case_index, embed_dim=embed_dim, num_heads=heads, **case["kwargs"])
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
    ours, ref = pair_with_torch(batch_first=True)
    ours.eval()
    ref.eval()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, E, generator=gen)
    kpm = bool_mask((3, 5), gen)
    with torch.no_grad():
        for call in ({}, {"key_padding_mask": kpm}, {"attn_mask": bool_mask((5, 5), gen)}):
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
