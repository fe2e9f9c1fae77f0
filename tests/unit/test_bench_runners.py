"""benchmarks/train/runners.py: the competitors the training benchmarks time compute the task's loss.
`ours:hostpacked` (data.packing=true: the packing built on the host when a batch moves to its device) has
the loss of the padded and the device-packed steps, with the fused loss too; a batch without its host
packing is refused; the task's settings combine with '+', nothing else does."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common.references import make_batches
from benchmarks.train import runners
from benchmarks.train.runners import build_runner
from transformer.config import TransformerConfig

CONFIG = TransformerConfig(
    src_vocab_size=50, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=2, d_ff=32, dropout=0.0
)


def test_the_host_packed_variant_has_the_tasks_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    (batch,) = make_batches(1, 6, 50, torch.Generator().manual_seed(0))
    assert batch.packing is None and batch.src.eq(0).any()
    moved = batch.to("cpu")  # as the benchmarks move their batches: the host packing is made here
    assert moved.packing is not None and moved.packing["src_index"].numel() == int(batch.src.ne(0).sum())
    losses = {name: build_runner(name, CONFIG, {}).loss_fn(moved).item() for name in ("ours", "ours:nopack")}
    fused_calls = []
    fused = runners.our_losses.linear_label_smoothed_cross_entropy
    monkeypatch.setattr(
        runners.our_losses,
        "linear_label_smoothed_cross_entropy",
        lambda *args, **kwargs: fused_calls.append(1) or fused(*args, **kwargs),
    )
    for variant in ("hostpacked", "fusedloss+hostpacked", "lowprecisionresidual+fusedloss+hostpacked"):
        host = build_runner(f"ours:{variant}", CONFIG, {})
        assert host.packed and host.packed_logits
        fused_calls.clear()
        for name, loss in losses.items():
            assert abs(host.loss_fn(moved).item() - loss) <= 1e-6 * abs(loss), (variant, name)
        assert bool(fused_calls) == ("fusedloss" in variant), variant


def test_only_the_tasks_settings_combine() -> None:
    residual = build_runner("ours:lowprecisionresidual+fusedloss", CONFIG, {}).model
    assert all(m.in_autocast_dtype for m in residual.modules() if hasattr(m, "in_autocast_dtype"))
    for name in ("ours:fusedloss+nopack", "ours:compiled+hostpacked", "ours:fusedlos", "ours:fusedloss+"):
        with pytest.raises(ValueError, match="unknown variant"):
            build_runner(name, CONFIG, {})


def test_the_host_packed_variant_needs_the_host_packing() -> None:
    (batch,) = make_batches(1, 4, 50, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"Batch\.to"):
        build_runner("ours:hostpacked", CONFIG, {}).loss_fn(batch)
