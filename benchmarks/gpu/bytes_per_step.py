"""Bytes a training step moves through GPU memory, counted on the CPU: every aten operation of one step of
bench_gpu.py's eager `ours` case (forward, label-smoothed loss, backward, fused AdamW) at the WMT-base shape,
run on fake tensors (no memory, no arithmetic) under the CUDA code path's settings, each operation charged
the bytes of the tensors it reads and writes.

    python -m benchmarks.gpu.bytes_per_step [--batch-tokens 25000] [--vocab 32000] [--smoke]
        [--results-dir DIR]

What makes it the GPU's step on a CPU-only torch:
- the CUDA branches of the project's kernels (attention without the fully-masked-row fix-up, the loss's
  64M-element chunks and its one-kernel gradient write), as tests/unit/test_op_counts.py's `cuda_path`;
- CUDA autocast's policy (CPU autocast leaves LayerNorm and softmax in bf16, CUDA runs them in float32):
  the float32 operations of CUDA's list are registered for the CPU's autocast key while counting;
- padded batches (`pack_tokens` off), as on a GPU.
Each operation's bytes are the least it must move: its tensor inputs read once, its outputs written once
(in-place and out= operations: the written tensor once more); views and allocations cost nothing. That is
a floor for each kernel, not a measurement: a matrix multiply's tiles re-read more, a fused kernel less.
The categories (matmul, attention, loss, casts/copies, norm, residual and dropout, activation, embedding,
optimizer, other) follow the region an operation runs in (the loss's forward and backward, the optimizer
step) and then its name. Operations that touch memory are counted as launches (a foreach operation
counts once per tensor list, a lower bound).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.common.references import PAD
from benchmarks.common.shapes import SMOKE, WMT_BASE, wmt_batches
from benchmarks.train.runners import LABEL_SMOOTHING
from transformer import dropout, kernels, losses
from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer
from transformer.norm import residual_in_autocast_dtype

CATEGORIES = (
    "matmul", "attention", "loss", "casts/copies", "norm", "residual+dropout", "activation", "embedding",
    "optimizer", "other",
)  # fmt: skip
_BY_NAME = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "_addmm_activation"),
    "attention": ("scaled_dot_product", "_efficient_attention", "_flash_attention", "_cudnn_attention"),
    "casts/copies": ("_to_copy", "copy_", "clone", "cat", "stack"),
    "norm": ("native_layer_norm", "layer_norm", "native_layer_norm_backward"),
    "residual+dropout": (
        "add",
        "native_dropout",
        "native_dropout_backward",
        "bernoulli",
        "mul",
        "div",
        "masked_fill",
        "where",
    ),
    "activation": ("relu", "gelu", "silu", "threshold_backward", "gelu_backward", "silu_backward"),
    "embedding": ("embedding", "index_select", "embedding_dense_backward"),
}
# allocations and metadata: no bytes moved, no launch
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
         "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size", "alias",
         "_unsafe_view", "_reshape_alias"}  # fmt: skip
# CUDA autocast's float32 operations that the model and loss use and CPU autocast leaves in low precision
# (torch/csrc/autocast_mode.cpp: KERNEL_CUDA(..., fp32) and fp32_set_opt_dtype)
_CUDA_FP32 = ("layer_norm", "softmax.int", "log_softmax.int", "exp", "log", "pow.Tensor_Scalar", "rsqrt")


class ByteCounter(TorchDispatchMode):
    """Bytes read and written, operations and launches by category, for every aten operation under it.
    `region` (set by `ByteCounter.inside`) overrides the name-based category."""

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[str, int] = defaultdict(int)
        self.written: dict[str, int] = defaultdict(int)
        self.launches: dict[str, int] = defaultdict(int)
        self.by_op: dict[str, int] = defaultdict(int)
        self.region: str | None = None

    @contextlib.contextmanager
    def inside(self, region: str) -> Iterator[None]:
        outer, self.region = self.region, region
        try:
            yield
        finally:
            self.region = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace != "aten" or name in _FREE or func.is_view:
            return out
        read, written = moved_bytes(func._schema, args, kwargs, out)
        if read + written == 0:
            return out
        category = self.region or category_of(name)
        self.read[category] += read
        self.written[category] += written
        self.launches[category] += 1
        self.by_op[f"{category}: {name}"] += read + written
        return out

    def total(self) -> int:
        return sum(self.read.values()) + sum(self.written.values())


def moved_bytes(schema: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    """(read, written) bytes of one call, from its schema: every tensor argument is read except out=
    ones; every argument the operation writes (in place, out=) is written, and every returned tensor
    that is not one of those arguments."""
    values = {a.name: v for a, v in zip(schema.arguments, args)} | kwargs
    read = written = 0
    for argument in schema.arguments:
        size = _nbytes(values.get(argument.name))
        if not argument.is_out:
            read += size
        if argument.alias_info is not None and argument.alias_info.is_write:
            written += size
    returns = out if len(schema.returns) > 1 else (out,)
    written += sum(_nbytes(value) for r, value in zip(schema.returns, returns) if r.alias_info is None)
    return read, written


def _nbytes(value: Any) -> int:
    """Bytes of a tensor, or of the tensors in a list or tuple."""
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def category_of(name: str) -> str:
    """An aten operation's category by its name (the first rule of _BY_NAME that matches)."""
    base = name.removeprefix("_foreach_")
    for category, names in _BY_NAME.items():
        if any(base == n or base == n + "_" or (n.startswith("_") and base.startswith(n)) for n in names):
            return category
        if category == "attention" and any(n in base for n in names):
            return category
    return "other"


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """CPU autocast with CUDA's float32 list for the operations in _CUDA_FP32 (inputs cast to float32,
    as CUDA autocast does), while the context is open."""
    library = torch.library.Library("aten", "IMPL")
    for qualified in _CUDA_FP32:
        name, _, overload = qualified.partition(".")
        op = getattr(getattr(torch.ops.aten, name), overload or "default")
        library.impl(qualified, _in_float32(op), "AutocastCPU")
    try:
        yield
    finally:
        library._destroy()


def _in_float32(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        lowp = (torch.bfloat16, torch.float16)
        args = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype in lowp else a for a in args)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return op(*args, **kwargs)

    return kernel


class _CudaDropout:
    """`torch.nn.functional` as transformer/dropout.py sees it on CUDA: `dropout` is one `native_dropout`
    kernel (the input read, the output and a boolean mask written; its backward reads the mask), where
    the CPU's `F.dropout` draws, scales and multiplies in three."""

    @staticmethod
    def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
        return torch.native_dropout(x, p, training)[0]


@contextlib.contextmanager
def cuda_code_path() -> Iterator[None]:
    """The CUDA branches of kernels.py, losses.py and dropout.py, taken on the CPU."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(dropout, "_OWN_MASK_DEVICES", frozenset()))
        stack.enter_context(mock.patch.object(dropout, "F", _CudaDropout))
        stack.enter_context(mock.patch.object(kernels, "_SDPA_ZEROES_EMPTY_ROWS", frozenset({"cpu"})))
        stack.enter_context(mock.patch.object(kernels, "_WITHOUT_CUDNN_DEVICES", frozenset({"cpu"})))
        chunk = losses._CHUNK_ELEMENTS_BY_DEVICE["cuda"]
        stack.enter_context(mock.patch.object(losses, "_CHUNK_ELEMENTS", chunk))
        stack.enter_context(mock.patch.object(losses, "_ONE_KERNEL_GRAD_WRITE", frozenset({"cpu"})))
        yield


def count_step(
    config: TransformerConfig, batch: Any, bf16: bool = True, low_precision_residual: bool = False
) -> ByteCounter:
    """The second training step of `config` on `batch` (bench_gpu's eager `ours`; the first makes the
    optimizer's state), counted on fake tensors."""
    counter = ByteCounter()
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, cuda_code_path(), cuda_autocast_policy():
        torch.manual_seed(0)
        model = Seq2SeqTransformer(config).train()
        model.pack_tokens = False  # padded batches, as on a GPU
        residual_in_autocast_dtype(model, low_precision_residual)  # model.low_precision_residual
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        src, tgt_in, tgt_out = (fake.from_tensor(t) for t in (batch.src, batch.tgt_in, batch.tgt_out))
        forward, backward = losses._LabelSmoothedNLL.forward, losses._LabelSmoothedNLL.backward

        def counted_forward(ctx: Any, *args: Any) -> Any:
            with counter.inside("loss"):
                return forward(ctx, *args)

        def counted_backward(ctx: Any, *args: Any) -> Any:
            with counter.inside("loss"):
                return backward(ctx, *args)

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(src, tgt_in)
                loss = losses.label_smoothed_cross_entropy(
                    logits, tgt_out, ignore_index=PAD, label_smoothing=LABEL_SMOOTHING
                ).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            with counter.inside("optimizer"):
                optimizer.step()

        step()  # the first step makes the optimizer's state: not what every step costs
        with (
            mock.patch.object(losses._LabelSmoothedNLL, "forward", staticmethod(counted_forward)),
            mock.patch.object(losses._LabelSmoothedNLL, "backward", staticmethod(counted_backward)),
            counter,
        ):
            step()
    return counter


def table(counter: ByteCounter, batch: Any) -> tuple[str, dict[str, Any]]:
    total = counter.total()
    head = f"{'category':18} {'read GB':>8} {'written GB':>10} {'total GB':>9}"
    lines = [f"{head} {'share':>6} {'launches':>8}"]
    for category in CATEGORIES:
        read, written = counter.read.get(category, 0), counter.written.get(category, 0)
        if read + written:
            lines.append(
                f"{category:18} {read / 1e9:8.2f} {written / 1e9:10.2f} {(read + written) / 1e9:9.2f} "
                f"{100 * (read + written) / total:5.1f}% {counter.launches[category]:8d}"
            )
    launches = sum(counter.launches.values())
    lines.append(f"{'all':18} {'':>8} {'':>10} {total / 1e9:9.2f} {'100%':>6} {launches:8d}")
    top = sorted(counter.by_op.items(), key=lambda item: -item[1])[:15]
    lines += ["", "largest operations (category: aten op, GB read + written)"]
    lines += [f"  {name:50} {value / 1e9:8.2f}" for name, value in top]
    figures = {
        "total_gb": total / 1e9,
        "launches": launches,
        "by_category_gb": {
            c: (counter.read[c] + counter.written[c]) / 1e9 for c in CATEGORIES if c in counter.read
        },
        "tokens": int(batch.src.numel() + batch.tgt_in.numel()),
        "non_pad_tokens": int(batch.src.ne(PAD).sum() + batch.tgt_out.ne(PAD).sum()),
    }
    return "\n".join(lines), figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-tokens", type=int, default=25_000, help="non-pad tokens per side")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--fp32", action="store_true", help="no autocast (the CPU's default)")
    parser.add_argument(
        "--low-precision-residual", action="store_true", help="model.low_precision_residual=true"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, in seconds")
    parser.add_argument("--results-dir", default=None, help="also write DIR/<date>_bytes_per_step.txt")
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else WMT_BASE
    if args.smoke:
        args.batch_tokens, args.vocab = 300, 1000
    config = TransformerConfig(src_vocab_size=args.vocab, max_len=256, **shape)
    batches = wmt_batches(8, args.batch_tokens, args.vocab)
    batch = sorted(batches, key=lambda b: b.src.numel() + b.tgt_in.numel())[len(batches) // 2]  # the median
    counter = count_step(config, batch, not args.fp32, args.low_precision_residual)
    text, figures = table(counter, batch)
    padding = 1 - figures["non_pad_tokens"] / figures["tokens"]
    head = (
        f"bytes_per_step: one training step (forward, loss, backward, fused AdamW), CUDA code path, "
        f"{'fp32' if args.fp32 else 'bf16 autocast (CUDA policy)'}"
        f"{', model.low_precision_residual' if args.low_precision_residual else ''}; "
        f"d_model {config.d_model}, "
        f"{config.n_encoder_layers}+{config.n_decoder_layers} layers, vocab {args.vocab}; batch "
        f"{tuple(batch.src.shape)} src + {tuple(batch.tgt_in.shape)} tgt = {figures['tokens']} tokens, "
        f"{100 * padding:.1f}% padding; torch {torch.__version__}"
    )
    result = {
        "benchmark": "bytes_per_step",
        **figures,
        "bf16": not args.fp32,
        "low_precision_residual": args.low_precision_residual,
        "smoke": args.smoke,
    }
    output = f"{head}\n\n{text}\n\n{json.dumps(result)}"
    print(output)
    if args.results_dir:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        suffix = "_low_precision_residual" if args.low_precision_residual else ""
        path = Path(args.results_dir) / f"{date}_bytes_per_step{suffix}.txt"
        path.write_text(output + "\n")
        print(f"written to {path}")
    return result


if __name__ == "__main__":
    main()
