"""benchmarks.gpu.bytes_per_step: the bytes each aten operation is charged (hand-counted cases), CUDA
autocast's float32 policy on the CPU while counting (and only then), and a whole step at toy sizes."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(scope="module")
def bps() -> ModuleType:
    from benchmarks.gpu import bytes_per_step

    return bytes_per_step


def _counted(bps: ModuleType, fn) -> tuple[dict, dict, dict]:
    counter = bps.ByteCounter()
    with counter:
        fn()
    return dict(counter.read), dict(counter.written), dict(counter.launches)


def test_operations_are_charged_their_tensors(bps: ModuleType) -> None:
    a, b = torch.randn(2, 3), torch.randn(3, 4)  # 24 and 48 bytes; a @ b: 32
    assert _counted(bps, lambda: a @ b)[:2] == ({"matmul": 24 + 48}, {"matmul": 32})
    x, y = torch.randn(5), torch.randn(5)
    assert _counted(bps, lambda: x.add_(y))[:2] == ({"residual+dropout": 40}, {"residual+dropout": 20})
    out = torch.empty(2, 3)  # out=: written, not read
    assert _counted(bps, lambda: torch.softmax(a, -1, out=out))[:2] == ({"other": 24}, {"other": 24})
    h = torch.randn(4, dtype=torch.float64)
    assert _counted(bps, lambda: h.to(torch.bfloat16))[:2] == ({"casts/copies": 32}, {"casts/copies": 8})
    # views and allocations move nothing
    assert _counted(bps, lambda: (a.t(), a.view(3, 2), torch.empty(100), a[0])) == ({}, {}, {})


def test_a_foreach_operation_writes_every_member(bps: ModuleType) -> None:
    params, grads = [torch.randn(3), torch.randn(7)], [torch.randn(3), torch.randn(7)]
    read, written, launches = _counted(bps, lambda: torch._foreach_add_(params, grads))
    assert read == {"residual+dropout": 80} and written == {"residual+dropout": 40}
    assert launches == {"residual+dropout": 1}


def test_the_region_overrides_the_name(bps: ModuleType) -> None:
    a = torch.randn(2, 3)
    counter = bps.ByteCounter()
    with counter, counter.inside("loss"):
        F.log_softmax(a, -1)
        a @ a.t()  # a matrix product stays a matmul in any region (the fused loss's projection)
    assert dict(counter.read) == {"loss": 24, "matmul": 48} and counter.region is None


def test_cuda_autocast_policy_only_while_counting() -> None:
    from benchmarks.gpu.cuda_on_cpu import cuda_autocast_policy

    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(x, (8,)).dtype == torch.float32  # CUDA autocast: LayerNorm in float32
        assert torch.softmax(x, -1).dtype == torch.float32
        assert F.linear(x.float(), x.float()).dtype == torch.bfloat16  # matmuls still in bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU's own policy again
        assert F.layer_norm(x, (8,)).dtype == torch.bfloat16


def test_a_toy_step(bps: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    result = bps.main(["--smoke"])
    by = result["by_category_gb"]
    assert sum(by.values()) == pytest.approx(result["total_gb"])
    for category in ("matmul", "attention", "loss", "norm", "optimizer", "casts/copies"):
        assert by[category] > 0, category
    assert result["tokens"] > result["non_pad_tokens"] > 0
    assert '"benchmark": "bytes_per_step"' in capsys.readouterr().out


def test_packing_runs_every_attention_in_the_varlen_kernel(bps: ModuleType) -> None:
    """data.packing: torch's variable-length attention kernel (its fake implementation, as CUDA takes it)
    for every attention of the step, forward and backward, and the matrix products on the kept rows only."""
    config, batch = bps.model_and_batch(300, 1000, smoke=True)
    assert batch.src.eq(0).any()  # padding to skip
    padded, packed = bps.count_step(config, batch), bps.count_step(config, batch, packing=True)
    assert {"attention: _varlen_attn", "attention: _varlen_attn_backward"} <= set(packed.by_op)
    assert not any("scaled_dot_product" in op for op in packed.by_op)
    assert not any("varlen" in op for op in padded.by_op)
    assert packed.read["matmul"] < padded.read["matmul"]
    assert packed.written["matmul"] < padded.written["matmul"]


def test_one_kernel_is_charged_its_inputs_and_outputs_once(bps: ModuleType) -> None:
    x = torch.randn(4, 8)  # 128 bytes; a softmax, a scaling and a sum inside, each a pass of their own
    counter = bps.ByteCounter()
    with counter, counter.inside("loss"):
        out = counter.one_kernel("fused", lambda t, k: (torch.softmax(t, -1) * k, t.sum(-1)), x, 2.0)
    assert out[0].shape == (4, 8)
    assert dict(counter.read) == {"loss": 128} and dict(counter.written) == {"loss": 128 + 16}
    assert dict(counter.launches) == {"loss": 1} and dict(counter.by_op) == {"loss: fused": 272}


def test_the_fused_loss_is_charged_its_own_operations(bps: ModuleType) -> None:
    """model.fused_loss: the same matrix products as the plain step (the projection and its two gradients,
    now inside the loss), charged as matmuls; each chunk's terms one compiled kernel as on CUDA, or with
    --eager-chunk the eager passes, which move more."""
    plain, fused = bps.main(["--smoke"]), bps.main(["--smoke", "--fused-loss"])
    eager = bps.main(["--smoke", "--fused-loss", "--eager-chunk"])
    assert fused["fused_loss"] and not plain["fused_loss"] and eager["eager_chunk"]
    for result in (fused, eager):
        assert result["by_category_gb"]["matmul"] == pytest.approx(plain["by_category_gb"]["matmul"])
    assert fused["by_category_gb"]["loss"] < plain["by_category_gb"]["loss"] < eager["by_category_gb"]["loss"]
    config, batch = bps.model_and_batch(300, 1000, smoke=True)
    compiled = bps.count_step(config, batch, fused_loss=True).by_op
    assert "loss: compiled _chunk_terms" in compiled and "loss: _log_softmax" not in compiled
    assert "loss: _log_softmax" in bps.count_step(config, batch, fused_loss=True, eager_chunk=True).by_op
