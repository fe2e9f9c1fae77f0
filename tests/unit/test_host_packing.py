"""Packing built on the host (#50 item 3): the collator's kept positions and cumulative lengths equal what
`TokenPacking` finds on the device; a training-style forward, loss and backward that takes them gives the
padded path's loss and gradients and reads nothing back (no nonzero, item, equal or boolean-mask index);
packed attention picks torch's variable-length kernel in one place (`kernels.use_varlen`) and falls back to
the padded layout, and the kernel's call gets the right layout (a stand-in with plain masked attention)."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from data.batching import TranslationCollator
from tests.helpers.tasks import logged_training_step
from tests.helpers.tiny import tiny_seq2seq
from transformer import kernels
from transformer.losses import label_smoothed_cross_entropy
from transformer.model import Seq2SeqTransformer
from transformer.packing import BatchPacking, TokenPacking, prefix_mask
from transformer.training import TranslationTask

PAD, VOCAB = 0, 40


def _examples(seed: int, batch: int = 7, longest: int = 11) -> list[dict[str, Any]]:
    """Random translation examples: sources of 1 .. longest tokens (one-token rows included), targets
    [BOS, 0 .. longest - 2 tokens, EOS] (so tgt_in is never empty); no pad id inside a sentence."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=generator).tolist()

    examples = []
    for row in range(batch):
        n_src = 1 if row == 0 else int(torch.randint(1, longest + 1, (1,), generator=generator))
        n_tgt = 0 if row == 1 else int(torch.randint(0, longest - 1, (1,), generator=generator))
        examples.append({"id": row, "src_ids": ids(n_src), "tgt_ids": [1, *ids(n_tgt), 2]})
    return examples


def _batch(seed: int, **kwargs: Any) -> dict[str, Any]:
    return TranslationCollator(PAD, packing=True)(_examples(seed, **kwargs))


def _assert_same_packing(host: TokenPacking, device: TokenPacking) -> None:
    assert (host.batch, host.length) == (device.batch, device.length)
    assert torch.equal(host.keep, device.keep) and torch.equal(host.index, device.index)
    assert torch.equal(host.positions, device.positions)
    lengths = device.keep.sum(dim=1)  # (B,)
    assert host.cu_seqlens is not None and host.cu_seqlens.dtype == torch.int32
    assert torch.equal(host.cu_seqlens, F.pad(lengths.cumsum(0), (1, 0)).int())
    assert host.max_len == int(lengths.max()) and isinstance(host.max_len, int)
    rows = torch.randn(host.batch, host.length, 3)
    assert torch.equal(host.pack(rows), device.pack(rows))
    assert torch.equal(host.unpack(host.pack(rows)), device.unpack(device.pack(rows)))


@pytest.mark.parametrize("seed", range(6))
def test_host_packing_equals_the_device_packing(seed: int) -> None:
    batch = _batch(seed, batch=1 + seed, longest=2 + 3 * seed)
    packing = BatchPacking.from_collated(batch["packing"], batch["src"], batch["tgt_in"])
    _assert_same_packing(packing.source, TokenPacking(batch["src"].ne(PAD)))
    _assert_same_packing(packing.target, TokenPacking(prefix_mask(batch["tgt_in"], PAD)))
    # for a loss: the target packing holds every non-pad target, so tgt_out at it has them all
    assert torch.equal(packing.target.pack(batch["tgt_out"]), batch["tgt_out"][batch["tgt_out"].ne(PAD)])


def test_the_collator_adds_packing_only_when_asked() -> None:
    examples = _examples(0)
    plain, packed = TranslationCollator(PAD)(examples), TranslationCollator(PAD, packing=True)(examples)
    assert "packing" not in plain and set(packed) == {*plain, "packing"}
    assert all(torch.equal(plain[key], packed[key]) for key in plain)
    assert set(packed["packing"]) == {
        f"{side}_{name}" for side in ("src", "tgt") for name in ("index", "cu_seqlens", "max_len")
    }
    assert "packing" not in TranslationCollator(PAD, packing=True)([{"id": 0, "src_ids": [4, 5]}])


def _model(dropout: float = 0.0, **overrides: Any) -> Seq2SeqTransformer:
    return tiny_seq2seq(1, vocab=VOCAB, layers=2, dropout=dropout, **overrides).train()


def _padded_step(model: Seq2SeqTransformer, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    model.pack_tokens = False
    logits = model(batch["src"], batch["tgt_in"])  # (B, T, V)
    return _loss_and_grads(model, logits, batch["tgt_out"])


def _host_packed_step(model: Seq2SeqTransformer, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    """What the translation task's step does with a collated packing (`_token_loss`)."""
    model.pack_tokens = False  # the GPU's setting: the packing is taken because it is given
    packing = BatchPacking.from_collated(batch["packing"], batch["src"], batch["tgt_in"])
    logits = model(batch["src"], batch["tgt_in"], packing=packing)  # (N, V)
    return _loss_and_grads(model, logits, packing.target.pack(batch["tgt_out"]))


def _device_packed_step(model: Seq2SeqTransformer, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    """The CPU's packed step today: the packing found on the device."""
    model.pack_tokens = True
    keep = batch["tgt_out"].ne(PAD)
    logits = model(batch["src"], batch["tgt_in"], positions=keep)  # (N, V)
    return _loss_and_grads(model, logits, batch["tgt_out"][keep])


def _loss_and_grads(
    model: Seq2SeqTransformer, logits: Tensor, target: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = label_smoothed_cross_entropy(logits, target, ignore_index=PAD, label_smoothing=0.1).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(got: tuple[Tensor, dict[str, Tensor]], want: tuple[Tensor, dict[str, Tensor]]) -> None:
    (loss, grads), (want_loss, want_grads) = got, want
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        # 1e-6 relative to the gradient's size (an element near 0 has no meaningful relative error)
        scale = want_grads[name].abs().max().item()
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-6, atol=1e-6 * scale, msg=name)


CONFIGS = {
    "sinusoidal-tied": {},
    "untied": {"tie_embeddings": "none"},
    "learned": {"positional": "learned"},
    "rope-prenorm": {"positional": "rope", "norm_first": True},
}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_host_packed_step_equals_the_padded_step(overrides: dict[str, Any]) -> None:
    model, batch = _model(**overrides), _batch(3)
    assert batch["src"].eq(PAD).any() and batch["tgt_in"].eq(PAD).any()
    _assert_same_step(_host_packed_step(model, batch), _padded_step(model, batch))


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_host_packed_step_with_dropout_equals_the_device_packed_step(overrides: dict[str, Any]) -> None:
    """With dropout the padded path draws other masks, but the two packed paths draw the same ones."""
    model, batch = _model(dropout=0.2, **overrides), _batch(4)
    torch.manual_seed(7)
    host = _host_packed_step(model, batch)
    torch.manual_seed(7)
    _assert_same_step(host, _device_packed_step(model, batch))
    torch.manual_seed(8)
    assert not torch.equal(_host_packed_step(model, batch)[0], host[0])  # dropout is on


def test_forward_takes_positions_or_packing_not_both() -> None:
    model, batch = _model(), _batch(0)
    packing = BatchPacking.from_collated(batch["packing"], batch["src"], batch["tgt_in"])
    with pytest.raises(ValueError, match="positions or packing"):
        model(batch["src"], batch["tgt_in"], positions=packing.target.keep, packing=packing)


# --- no host read ----------------------------------------------------------------------------------

_HOST_READS = {
    "aten::nonzero",
    "aten::_local_scalar_dense",
    "aten::equal",
    "aten::is_nonzero",
    "aten::masked_select",
}


class _HostReads(TorchDispatchMode):
    """The aten ops of a pass that read device data back to the host (a sync on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name
        bool_index = name == "aten::index" and any(
            isinstance(i, Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
        )  # x[mask]: a nonzero inside the kernel
        if name in _HOST_READS or bool_index:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides", [{}, {"positional": "rope"}], ids=["sinusoidal", "rope"])
def test_host_packed_step_reads_nothing_back(overrides: dict[str, Any]) -> None:
    model, batch = _model(**overrides), _batch(5)
    counter = _HostReads()
    with counter:
        _host_packed_step(model, batch)
    assert counter.reads == []
    with counter:  # the counter sees the device packing's reads
        _device_packed_step(model, batch)
    assert "aten::nonzero" in counter.reads and "aten::index" in counter.reads


# --- the choice of packed attention and the variable-length kernel's wiring -------------------------


def test_the_cpu_falls_back_to_the_padded_layout() -> None:
    x = torch.randn(5, 16)
    lengths = (torch.tensor([0, 5], dtype=torch.int32), 5)
    assert not kernels.use_varlen(x, 4, 0.0, False, lengths, lengths)  # no CPU kernel in any torch


def test_use_varlen_needs_kernel_lengths_no_dropout_no_rotary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_varlen_attn", _reference_varlen_attn)
    monkeypatch.setattr(kernels, "_VARLEN_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(kernels, "_VARLEN_DTYPES", frozenset({torch.float32}))
    x, known, unknown = torch.randn(5, 16), (torch.tensor([0, 5], dtype=torch.int32), 5), (None, None)
    assert kernels.use_varlen(x, 8, 0.0, False, known, known)
    assert not kernels.use_varlen(x.double(), 8, 0.0, False, known, known)  # dtype
    assert not kernels.use_varlen(x, 8, 0.1, False, known, known)  # attention dropout
    assert not kernels.use_varlen(x, 8, 0.0, True, known, known)  # rotary
    assert not kernels.use_varlen(x, 8, 0.0, False, known, unknown)  # a packing found on the device
    assert not kernels.use_varlen(x, 6, 0.0, False, known, known)  # head dim: a multiple of 8
    assert not kernels.use_varlen(x, 4, 0.0, False, known, known)
    assert kernels.use_varlen(x, 256, 0.0, False, known, known)  # Flash Attention's largest
    assert not kernels.use_varlen(x, 264, 0.0, False, known, known)
    monkeypatch.setattr(kernels, "_varlen_attn", None)  # a torch without the kernel
    assert not kernels.use_varlen(x, 8, 0.0, False, known, known)


def _reference_varlen_attn(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> Tensor:
    """torch's `varlen_attn` (2.13's signature) written out: plain softmax attention per sequence."""
    assert query.dim() == key.dim() == value.dim() == 3 and key.shape == value.shape
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32 and cu_seq_q.shape == cu_seq_k.shape
    assert isinstance(max_q, int) and isinstance(max_k, int) and window_size in ((-1, -1), (-1, 0))
    assert int(cu_seq_q[-1]) == query.size(0) and int(cu_seq_k[-1]) == key.size(0)
    out = []
    for b in range(cu_seq_q.numel() - 1):
        q = query[int(cu_seq_q[b]) : int(cu_seq_q[b + 1])].transpose(0, 1)  # (H, Tb, Dh)
        k = key[int(cu_seq_k[b]) : int(cu_seq_k[b + 1])].transpose(0, 1)  # (H, Sb, Dh)
        v = value[int(cu_seq_k[b]) : int(cu_seq_k[b + 1])].transpose(0, 1)
        assert q.size(1) <= max_q and k.size(1) <= max_k
        scores = q @ k.transpose(1, 2) / math.sqrt(q.size(-1))  # (H, Tb, Sb)
        if window_size == (-1, 0):
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(dim=-1) @ v).transpose(0, 1))  # (Tb, H, Dh)
    return torch.cat(out)  # (N, H, Dh)


def _torch_2_10_varlen_attn(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool = False,
) -> Tensor:
    """The same, with torch 2.10's way of asking for causality."""
    window = (-1, 0) if is_causal else (-1, -1)
    return _reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window)


@pytest.mark.parametrize("kernel", [_reference_varlen_attn, _torch_2_10_varlen_attn], ids=["2.13", "2.10"])
@pytest.mark.parametrize(
    "overrides", [{}, {"norm_first": True, "tie_embeddings": "none"}], ids=["post", "pre"]
)
def test_varlen_kernel_gets_the_packed_layout(monkeypatch: pytest.MonkeyPatch, kernel, overrides) -> None:  # type: ignore[no-untyped-def]
    """With the kernel 'available' on the CPU (a plain-attention stand-in), the host-packed step calls it
    for every attention (encoder self, decoder causal self, cross) and matches the padded step."""
    calls: list[tuple[tuple[int, ...], tuple[int, ...], Tensor, Tensor, bool]] = []

    def recording(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options):  # type: ignore[no-untyped-def]
        causal = options.get("window_size") == (-1, 0) or options.get("is_causal", False)
        calls.append((tuple(query.shape), tuple(key.shape), cu_seq_q, cu_seq_k, causal))
        return kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options)

    recording.__signature__ = inspect.signature(kernel)  # type: ignore[attr-defined]
    model, batch = _model(**overrides), _batch(6)
    want = _padded_step(model, batch)
    monkeypatch.setattr(kernels, "_varlen_attn", recording)
    monkeypatch.setattr(kernels, "_VARLEN_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(kernels, "_VARLEN_DTYPES", frozenset({torch.float32}))
    _assert_same_step(_host_packed_step(model, batch), want)

    packing = BatchPacking.from_collated(batch["packing"], batch["src"], batch["tgt_in"])
    src_cu, tgt_cu = packing.source.cu_seqlens, packing.target.cu_seqlens
    m, n, heads, d_head = len(packing.source), len(packing.target), 4, 8
    encoder = [((m, heads, d_head), (m, heads, d_head), src_cu, src_cu, False)] * 2
    decoder = [
        ((n, heads, d_head), (n, heads, d_head), tgt_cu, tgt_cu, True),  # self: causal over each prefix
        ((n, heads, d_head), (m, heads, d_head), tgt_cu, src_cu, False),  # cross: to each row's source
    ] * 2
    assert len(calls) == len(encoder + decoder)
    for got, expected in zip(calls, encoder + decoder, strict=True):
        assert got[:2] == expected[:2] and got[4] == expected[4]
        assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])


# --- the task: `data.packing` batches through TranslationTask's training step -------------------------


def _task_step(batch: dict[str, Any], *, packed: bool, fused: bool) -> tuple[dict[str, Tensor], dict]:
    """One `TranslationTask.training_step` and its backward (no Trainer): the logged train/* values and
    every parameter's gradient. Seed 0 draws the same weights every time."""
    torch.manual_seed(0)
    config = dict(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=16, n_heads=2, n_encoder_layers=1,
                  n_decoder_layers=2, d_ff=32, dropout=0.0, max_len=32)  # fmt: skip
    task = TranslationTask(config, label_smoothing=0.1, fused_loss=fused).train()
    task.model.pack_tokens = packed
    return logged_training_step(task, batch)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("packed", [True, False], ids=["cpu-packed", "padded"])
def test_a_task_step_on_host_packed_batches_equals_the_step_without(packed: bool, fused: bool) -> None:
    """The task takes the batch's host-built packing (`data.packing=true`) whatever the model's own
    packing setting: the same loss, logged train/* values and gradients as the batch without it."""
    batch = _batch(5)
    without = {k: v for k, v in batch.items() if k != "packing"}
    logged, grads = _task_step(batch, packed=packed, fused=fused)
    want_logged, want_grads = _task_step(without, packed=packed, fused=fused)
    assert logged.keys() == want_logged.keys() and "train/token_acc" in logged
    for name, value in logged.items():
        torch.testing.assert_close(value, want_logged[name], rtol=1e-6, atol=0, msg=name)
    _assert_same_step((logged["returned loss"], grads), (want_logged["returned loss"], want_grads))


def test_a_task_step_on_host_packed_batches_reads_nothing_back() -> None:
    """The step takes the host packing (the model's own packing, the CPU's default, would find its
    packing on the device: nonzero) and never reads device data."""
    batch = _batch(6)
    counter = _HostReads()
    with counter:
        _task_step(batch, packed=True, fused=False)
    assert counter.reads == []
    with counter:  # the counter sees the model's own packing
        _task_step({k: v for k, v in batch.items() if k != "packing"}, packed=True, fused=False)
    assert "aten::nonzero" in counter.reads


# --- a decoder that starts from the pad token (an imported OPUS-MT model: bos_id == pad_id) ------------


def _pad_start_examples(seed: int, batch: int = 6) -> list[dict[str, Any]]:
    """Marian's framing: targets [PAD, y1 .. yn, EOS] (the decoder's first input is the pad id), one of
    them empty ([PAD, EOS]: tgt_in is the pad id alone, tgt_out its EOS), sources without BOS."""
    examples = _examples(seed, batch=batch)
    for example in examples:
        example["tgt_ids"][0] = PAD
    examples[1]["tgt_ids"] = [PAD, 2]  # an empty target sentence
    return examples


def test_host_packing_keeps_the_pad_start_token_of_every_target() -> None:
    batch = TranslationCollator(PAD, packing=True)(_pad_start_examples(0))
    assert batch["tgt_in"][:, 0].eq(PAD).all()  # the start token is the pad id in every row
    packing = BatchPacking.from_collated(batch["packing"], batch["src"], batch["tgt_in"])
    assert packing.target.keep[:, 0].all()  # position 0 is an input, not padding, in every row
    lengths = batch["tgt_out"].ne(PAD).sum(dim=1)  # (B,): each target's tokens, its EOS included
    assert torch.equal(packing.target.keep.sum(dim=1), lengths)
    assert torch.equal(packing.target.cu_seqlens, F.pad(lengths.cumsum(0), (1, 0)).int())
    assert packing.target.max_len == int(lengths.max())
    # every scored token (the empty sentence's EOS too) is at a packed position
    assert torch.equal(packing.target.pack(batch["tgt_out"]), batch["tgt_out"][batch["tgt_out"].ne(PAD)])
    device = TokenPacking(prefix_mask(batch["tgt_in"], PAD))  # what the model finds itself
    _assert_same_packing(packing.target, device)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_pad_start_model_steps_the_same_host_packed_device_packed_and_padded(seed: int) -> None:
    """bos_id == pad_id: the packed steps (host-built and device-found packing) give the padded step's loss
    and gradients, so the first target position and an empty sentence's EOS are trained on."""
    model = _model(bos_id=PAD)
    batch = TranslationCollator(PAD, packing=True)(_pad_start_examples(seed))
    padded = _padded_step(model, batch)
    _assert_same_step(_host_packed_step(model, batch), padded)
    _assert_same_step(_device_packed_step(model, batch), padded)
