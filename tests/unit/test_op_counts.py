"""Kernel launches on the GPU's code path, counted on the CPU: the label-smoothed loss (forward + backward)
and its passes over the (N, V) logits, one masked attention call, one decoding step. A test fails when a
count grows; when a change lowers one on purpose, lower the number here with it.

What runs is the CUDA code, chosen the way the sync tests choose it (tests/unit/test_decoding_syncs.py):
no token packing, the attention kernels' device check says "not the CPU", the kernel runs without cuDNN's
backend and torch's chooser says "memory-efficient" (what a masked call then gets on a CUDA GPU), the loss
splits its rows into chunks and writes each chunk's gradient with one addcmul. Every aten operator that is
not a view or a host-only call counts as one launch (`Launches`, tests/helpers/launches.py); the fused
attention kernel counts as one, as on a GPU (the CPU's SDPA runs unobserved inside it), plus one for a
boolean mask, which SDPA first turns into the additive one its kernels compute with (a `where`).
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.nn.attention import SDPBackend

from tests.helpers.launches import Launches
from tests.helpers.tiny import tiny_seq2seq, tiny_sources
from transformer import MultiHeadAttention, kernels, losses
from transformer.losses import label_smoothed_cross_entropy
from transformer.search.decoding import DecodingSettings, search

pytestmark = pytest.mark.usefixtures("one_thread")

# --- the loss ------------------------------------------------------------------------------------------

N, V, CHUNK_ROWS = 12, 16, 4  # 3 chunks of 4 rows


def _loss_launches(dtype: torch.dtype) -> tuple[Launches, Launches, int, int]:
    """Forward and backward launches of the loss over (N, V) logits; the logits' and gradient's storages."""
    torch.manual_seed(0)
    logits = torch.randn(N, V).to(dtype).requires_grad_()
    target = torch.randint(1, V, (N,))
    target[-3:] = 0  # padding
    forward, backward = Launches(V, rows=N), Launches(V, rows=N)
    with forward:
        out = label_smoothed_cross_entropy(logits, target, label_smoothing=0.1)
        total = out.loss + out.nll
    with backward:
        total.backward()
    assert logits.grad is not None
    return forward, backward, logits.untyped_storage().data_ptr(), logits.grad.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loss_launches_and_passes_over_the_logits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per chunk of rows: forward upcast (16-bit) + log-softmax + 3 reductions; backward upcast (16-bit) +
    softmax + one addcmul into the gradient. 16-bit logits: the padded logits are read twice and the
    gradient written once (3 passes); the float32 chunk temporaries see 9 passes, which on a GPU stay in L2.
    float32 logits: no upcast; the gradient's rows hold the softmax, so it is written twice and read once."""
    # the GPU's rule, rows in chunks, at the test's size (raising=False: so that older code fails on counts)
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS_BY_DEVICE", {"cpu": CHUNK_ROWS * V}, raising=False)
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", CHUNK_ROWS * V)
    monkeypatch.setattr(losses, "_ONE_KERNEL_GRAD_WRITE", frozenset({"cpu"}), raising=False)  # as on CUDA
    chunks = N // CHUNK_ROWS
    forward, backward, logits, grad = _loss_launches(dtype)
    upcast = int(dtype != torch.float32)
    per_chunk_forward = ["_to_copy"] * upcast + ["_log_softmax", "gather", "sum", "amax"]
    per_chunk_backward = ["_to_copy"] * upcast + ["_softmax", "addcmul"]
    assert forward.names.count("_log_softmax") == chunks
    # the fixed part: forward, the 3 chunk results joined (cat), 4 per-token terms, 3 + 11 for the masks, the
    # counts and the means, 1 for the test's sum; backward, 5 through the means, 2 + 4 for the per-token
    # factors and the gold column's gradient, arange + index_put_ to write it (+ a 16-bit copy first)
    assert len(forward.names) == len(per_chunk_forward) * chunks + 22, forward.names
    assert len(backward.names) == len(per_chunk_backward) * chunks + 13 + upcast, backward.names

    known = (logits, grad)
    assert (forward.passes("r", logits), backward.passes("r", logits)) == (1.0, 1.0)
    assert forward.passes("w", None, known) + forward.passes("r", None, known) == (5 if upcast else 3)
    grad_passes = (backward.passes("w", grad), backward.passes("r", grad))
    temporaries = backward.passes("w", None, known) + backward.passes("r", None, known)
    assert (*grad_passes, temporaries) == ((1.0, 0.0, 4) if upcast else (2.0, 1.0, 0))


# --- one masked attention call -------------------------------------------------------------------------

E, H = 16, 2


def _attention_launches(**call: Any) -> list[str]:
    """Launches of one MultiHeadAttention self-attention call over a padded (3, 5, E) batch."""
    torch.manual_seed(0)
    module = MultiHeadAttention(E, H, batch_first=True)
    x = torch.randn(3, 5, E)
    launches = Launches()
    with torch.no_grad(), launches:
        module(x, x, x, need_weights=False, **call)
    return launches.names


def _padding() -> Tensor:
    kpm = torch.zeros(3, 5, dtype=torch.bool)
    kpm[1, 3:] = kpm[2, 1:] = True  # ragged lengths
    return kpm


def test_a_masked_attention_call_adds_only_the_mask_to_the_fused_kernel(cuda_path: None) -> None:
    """Padding mask: the input projection, the mask's polarity flipped for SDPA and made additive by it, the
    kernel, the output projection (the heads merge as a view); an additive padding mask (the decoding
    caches' form, `kernels.additive_mask`) goes to the kernel as it is. Causal + padding: the causal mask
    (2) and its union (1) too. No fix-up for fully masked rows: the memory-efficient kernel returns zeros
    for them itself."""
    padded = _attention_launches(key_padding_mask=_padding())
    assert padded == ["addmm", "bitwise_not", "where", "scaled_dot_product_attention", "addmm"]
    additive = _attention_launches(key_padding_mask=kernels.additive_mask(_padding(), torch.float32))
    assert additive == ["addmm", "scaled_dot_product_attention", "addmm"]
    causal = _attention_launches(key_padding_mask=_padding(), is_causal=True)
    assert causal == [
        "addmm",
        "ones",
        "triu_",
        "bitwise_or",
        "bitwise_not",
        "where",
        "scaled_dot_product_attention",
        "addmm",
    ]


def test_kernels_that_may_leave_empty_rows_get_a_3_launch_fix_up(
    cuda_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch picks a kernel not known to zero fully masked rows (cuDNN's, on a device where it is not
    left out: not CUDA), 3 launches fix them up and the output keeps the kernel's layout (the heads still
    merge as a view, no copy)."""
    monkeypatch.setattr(kernels, "_WITHOUT_CUDNN_DEVICES", frozenset())
    monkeypatch.setattr(kernels, "_sdpa_backend", lambda *args: SDPBackend.CUDNN_ATTENTION, raising=False)
    fixed = _attention_launches(key_padding_mask=_padding())
    assert fixed == [
        "addmm", "bitwise_not", "any", "ge", "where", "scaled_dot_product_attention", "mul", "addmm"
    ]  # fmt: skip


# --- one decoding step ---------------------------------------------------------------------------------

VOCAB = 24


def _launches_per_step(settings: DecodingSettings) -> list[int]:
    """Launches of each decoding step (from one `decode` of the model to the next) of a batch of 8."""
    model = tiny_seq2seq(0, vocab=VOCAB)
    model.pack_tokens = False  # the GPU's encoder path
    src = tiny_sources(8, vocab=VOCAB)
    launches = Launches()
    starts: list[int] = []
    decode_step = model.decode

    def counted(*args: Any, **kwargs: Any) -> Tensor:
        starts.append(len(launches.names))
        return decode_step(*args, **kwargs)

    model.decode = counted  # type: ignore[method-assign]
    with launches:
        search(model, src, settings)
    ends = [*starts[1:], len(launches.names)]
    return [end - start for start, end in zip(starts, ends)]


@pytest.mark.parametrize(("beam_size", "typical", "most"), [(1, 50, 74), (4, 101, 129)])
def test_decoding_step_launches(cuda_path: None, beam_size: int, typical: int, most: int) -> None:
    """Launches per step of greedy and beam search (2 layers): a typical step, and the most any step takes
    (steps where sentences end also compact the caches). The masks reach the kernels in their additive
    form, made once per search (source padding) or per step (the beam layout's), not per layer: with
    boolean ones each layer took 2 launches more in greedy search (54 a typical step) and 4 in beam search
    (109)."""
    per_step = _launches_per_step(DecodingSettings(beam_size=beam_size, max_len_b=12))
    assert len(per_step) >= 10
    assert statistics.median(per_step) <= typical and max(per_step) <= most, per_step
