"""benchmarks/train/runners.py: the competitors the training benchmarks time compute the task's loss.
`ours:hostpacked` (data.packing=true: the packing built on the host when a batch moves to its device) has
the loss of the padded and the device-packed steps; a batch without its host packing is refused."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common.references import make_batches
from benchmarks.train.runners import build_runner
from transformer.config import TransformerConfig

CONFIG = TransformerConfig(
    src_vocab_size=50, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=2, d_ff=32, dropout=0.0
)


def test_the_host_packed_variant_has_the_tasks_loss() -> None:
    (batch,) = make_batches(1, 6, 50, torch.Generator().manual_seed(0))
    assert batch.packing is None and batch.src.eq(0).any()
    moved = batch.to("cpu")  # as the benchmarks move their batches: the host packing is made here
    assert moved.packing is not None and moved.packing["src_index"].numel() == int(batch.src.ne(0).sum())
    losses = {name: build_runner(name, CONFIG, {}).loss_fn(moved).item() for name in ("ours", "ours:nopack")}
    host = build_runner("ours:hostpacked", CONFIG, {})
    assert host.packed and host.packed_logits
    for name, loss in losses.items():
        assert abs(host.loss_fn(moved).item() - loss) <= 1e-6 * abs(loss), name


def test_the_host_packed_variant_needs_the_host_packing() -> None:
    (batch,) = make_batches(1, 4, 50, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"Batch\.to"):
        build_runner("ours:hostpacked", CONFIG, {}).loss_fn(batch)
