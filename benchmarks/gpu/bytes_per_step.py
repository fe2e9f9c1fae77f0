"""Bytes a training step moves through GPU memory, counted on the CPU: every aten operation of one step of
bench_gpu.py's eager `ours` case (forward, label-smoothed loss, backward, fused AdamW) at the WMT-base shape,
run on fake tensors (no memory, no arithmetic) under the CUDA code path's settings, each operation charged
the bytes of the tensors it reads and writes.

    python -m benchmarks.gpu.bytes_per_step [--batch-tokens 25000] [--vocab 32000] [--smoke]
        [--low-precision-residual] [--fused-loss] [--packing] [--results-dir DIR]

What makes it the GPU's step on a CPU-only torch:
- the CUDA branches of the project's kernels (attention without the fully-masked-row fix-up, the loss's
  64M-element chunks and its one-kernel gradient write), as tests/unit/test_op_counts.py's `cuda_path`;
- CUDA autocast's policy (CPU autocast leaves LayerNorm and softmax in bf16, CUDA runs them in float32):
  the float32 operations of CUDA's list are registered for the CPU's autocast key while counting;
- padded batches (`pack_tokens` off), as on a GPU; with `--packing` (data.packing=true) the batch's
  packing built on the host and torch's variable-length attention kernel (`varlen_attn`, which the CUDA
  path takes; its fake implementation runs here, charged as the Flash kernel's reads and writes).
`--fused-loss` is model.fused_loss=true (the projection and the loss chunk by chunk): each chunk's terms
after its matrix product are a compiled region on CUDA, charged as one kernel (inputs read once, outputs
written once: the floor a fused kernel reaches); `--eager-chunk` counts them as the eager operations.
Each operation's bytes are the least it must move: its tensor inputs read once, its outputs written once
(in-place and out= operations: the written tensor once more); views and allocations cost nothing. That is
a floor for each kernel, not a measurement: a matrix multiply's tiles re-read more, a fused kernel less.
The categories (matmul, attention, loss, casts/copies, norm, residual and dropout, activation, embedding,
optimizer, other) follow the region an operation runs in (the loss's forward and backward, the optimizer
step; a matrix product is a matmul in any region, the fused loss's projection too) and then its name.
Operations that touch memory are counted as launches (a foreach operation counts once per tensor list, a
lower bound).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.common.references import PAD, Batch
from benchmarks.common.shapes import SMOKE, WMT_BASE, wmt_batches
from benchmarks.gpu.cuda_on_cpu import cuda_autocast_policy, cuda_code_path
from benchmarks.train.runners import fused_token_loss, host_packed_token_loss, padded_token_loss
from data.batching import batch_packing
from transformer import losses
from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer
from transformer.norm import residual_in_autocast_dtype

CATEGORIES = (
    "matmul", "attention", "loss", "casts/copies", "norm", "residual+dropout", "activation", "embedding",
    "optimizer", "other",
)  # fmt: skip
_BY_NAME = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "_addmm_activation"),
    "attention": (
        "scaled_dot_product",
        "_efficient_attention",
        "_flash_attention",
        "_cudnn_attention",
        "_varlen_attn",
    ),
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
# operator namespaces counted besides aten's: torch's variable-length attention (`varlen_attn`'s custom ops)
_COUNTED_NAMESPACES = {"aten", "torch_attn"}
# allocations and metadata: no bytes moved, no launch
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
         "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size", "alias",
         "_unsafe_view", "_reshape_alias"}  # fmt: skip


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
        self._muted = 0

    @contextlib.contextmanager
    def inside(self, region: str) -> Iterator[None]:
        outer, self.region = self.region, region
        try:
            yield
        finally:
            self.region = outer

    def one_kernel(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` charged as one operation called `name` (a compiled region that fuses it): its
        tensor arguments read once, its tensor outputs written once, nothing for the operations inside:
        the floor such a kernel can reach (Inductor's may read an input twice, for a reduction and then a
        pointwise pass)."""
        self._muted += 1
        try:
            out = fn(*args)
        finally:
            self._muted -= 1
        self._charge(self.region or "other", name, _nbytes(args), _nbytes(out))
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self._muted or func.namespace not in _COUNTED_NAMESPACES or name in _FREE or func.is_view:
            return out
        read, written = moved_bytes(func._schema, args, kwargs, out)
        if read + written == 0:
            return out
        by_name = category_of(name)
        self._charge(by_name if by_name == "matmul" else self.region or by_name, name, read, written)
        return out

    def _charge(self, category: str, name: str, read: int, written: int) -> None:
        self.read[category] += read
        self.written[category] += written
        self.launches[category] += 1
        self.by_op[f"{category}: {name}"] += read + written

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


def count_step(
    config: TransformerConfig,
    batch: Any,
    bf16: bool = True,
    low_precision_residual: bool = False,
    *,
    fused_loss: bool = False,
    packing: bool = False,
    eager_chunk: bool = False,
) -> ByteCounter:
    """The second training step of `config` on `batch` (bench_gpu's eager `ours`, or with the settings
    model.low_precision_residual, model.fused_loss and data.packing as TranslationTask takes them; the
    first step makes the optimizer's state), counted on fake tensors. The fused loss's chunk terms are
    the compiled region CUDA runs (`losses._chunk_terms_on`), charged as one kernel, or with
    `eager_chunk` the eager operations the CPU runs (and CUDA without Triton)."""
    counter = ByteCounter()
    collated = batch_packing(batch.src.eq(PAD), batch.tgt_in, PAD) if packing else None  # on the host
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, cuda_code_path(), cuda_autocast_policy():
        torch.manual_seed(0)
        model = Seq2SeqTransformer(config).train()
        model.pack_tokens = False  # padded batches, as on a GPU
        residual_in_autocast_dtype(model, low_precision_residual)  # model.low_precision_residual
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        src, tgt_in, tgt_out = (fake.from_tensor(t) for t in (batch.src, batch.tgt_in, batch.tgt_out))
        if collated is not None:
            collated = {k: fake.from_tensor(v) if torch.is_tensor(v) else v for k, v in collated.items()}
        fake_batch = Batch(src, tgt_in, tgt_out, batch.n_tokens, collated)

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # the training loss as timed
                if collated is not None:  # ours:hostpacked (ours:fusedloss+hostpacked)
                    loss = host_packed_token_loss(model, fake_batch, fused=fused_loss)
                elif fused_loss:  # ours:fusedloss on the padded layout
                    loss = fused_token_loss(model, fake_batch, packs=False)
                else:  # ours on the padded layout
                    loss = padded_token_loss(
                        model, src, tgt_in, tgt_out, losses.label_smoothed_cross_entropy
                    ).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            with counter.inside("optimizer"):
                optimizer.step()

        step()  # the first step makes the optimizer's state: not what every step costs
        with contextlib.ExitStack() as stack:
            for function in (losses._LabelSmoothedNLL, losses._LinearLabelSmoothedCE):
                for name in ("forward", "backward"):
                    counted = _in_region(counter, "loss", getattr(function, name))
                    stack.enter_context(mock.patch.object(function, name, staticmethod(counted)))
            if "cuda" in losses._COMPILED_CHUNK_DEVICES and not eager_chunk:
                compiled = functools.partial(counter.one_kernel, "compiled _chunk_terms", losses._chunk_terms)
                stack.enter_context(mock.patch.object(losses, "_chunk_terms_on", lambda device: compiled))
            stack.enter_context(counter)
            step()
    return counter


def _in_region(counter: ByteCounter, region: str, method: Any) -> Any:
    def counted(ctx: Any, *args: Any) -> Any:
        with counter.inside(region):
            return method(ctx, *args)

    return counted


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


def model_and_batch(batch_tokens: int, vocab: int, smoke: bool = False) -> tuple[TransformerConfig, Any]:
    """The model's config (WMT-base, or the smoke shape) and the median of 8 of the sampler's batches."""
    config = TransformerConfig(src_vocab_size=vocab, max_len=256, **(SMOKE if smoke else WMT_BASE))
    batches = wmt_batches(8, batch_tokens, vocab)
    return config, sorted(batches, key=lambda b: b.src.numel() + b.tgt_in.numel())[len(batches) // 2]


# the switches of the step, as the options of the configuration name them
SETTINGS = {
    "low_precision_residual": "model.low_precision_residual",
    "fused_loss": "model.fused_loss",
    "packing": "data.packing",
    "eager_chunk": "the fused loss's chunk eager",
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-tokens", type=int, default=25_000, help="non-pad tokens per side")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--fp32", action="store_true", help="no autocast (the CPU's default)")
    parser.add_argument(
        "--low-precision-residual", action="store_true", help="model.low_precision_residual=true"
    )
    parser.add_argument("--fused-loss", action="store_true", help="model.fused_loss=true")
    parser.add_argument("--packing", action="store_true", help="data.packing=true (varlen attention)")
    parser.add_argument(
        "--eager-chunk", action="store_true", help="the fused loss's chunk in eager operations (no Triton)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, in seconds")
    parser.add_argument("--results-dir", default=None, help="also write DIR/<date>_bytes_per_step.txt")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch_tokens, args.vocab = 300, 1000
    config, batch = model_and_batch(args.batch_tokens, args.vocab, args.smoke)
    counter = count_step(
        config,
        batch,
        not args.fp32,
        args.low_precision_residual,
        fused_loss=args.fused_loss,
        packing=args.packing,
        eager_chunk=args.eager_chunk,
    )
    settings = [name for name in SETTINGS if getattr(args, name)]
    text, figures = table(counter, batch)
    padding = 1 - figures["non_pad_tokens"] / figures["tokens"]
    head = (
        f"bytes_per_step: one training step (forward, loss, backward, fused AdamW), CUDA code path, "
        f"{'fp32' if args.fp32 else 'bf16 autocast (CUDA policy)'}"
        f"{''.join(f', {SETTINGS[name]}' for name in settings)}; "
        f"d_model {config.d_model}, "
        f"{config.n_encoder_layers}+{config.n_decoder_layers} layers, vocab {args.vocab}; batch "
        f"{tuple(batch.src.shape)} src + {tuple(batch.tgt_in.shape)} tgt = {figures['tokens']} tokens, "
        f"{100 * padding:.1f}% padding; torch {torch.__version__}"
    )
    result = {
        "benchmark": "bytes_per_step",
        **figures,
        "bf16": not args.fp32,
        **{name: getattr(args, name) for name in SETTINGS},
        "smoke": args.smoke,
    }
    output = f"{head}\n\n{text}\n\n{json.dumps(result)}"
    print(output)
    if args.results_dir:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        suffix = "".join(f"_{name}" for name in settings)
        path = Path(args.results_dir) / f"{date}_bytes_per_step{suffix}.txt"
        path.write_text(output + "\n")
        print(f"written to {path}")
    return result


if __name__ == "__main__":
    main()
