"""Label-smoothed cross entropy alone: time and memory of forward + backward, now vs a baseline revision.

For (N tokens, V vocabulary) logits in float32 and bfloat16 (what autocast hands the loss on a GPU), per
implementation: the median seconds of `label_smoothed_cross_entropy(...).loss.backward()` (the two
implementations interleaved, the order alternating), the bytes autograd keeps between forward and backward
(saved tensors, counted with saved_tensors_hooks; "extra" leaves out the logits themselves, which exist
anyway), and the peak CPU memory the forward + backward allocate on top of the logits (torch.profiler's
allocation events, which carry the CPU allocator's running total). The reference row is
`F.cross_entropy(label_smoothing=...)` through autograd, timed the same way.

    python -m benchmarks.train.bench_loss [--baseline REV] [--shapes 2688x10000,4096x32000] [--repeats 5]
        [--threads N] [--chunks 18,20,22]   (ours with other chunk sizes, `losses._CHUNK_ELEMENTS` = 2^k)
        [--smoke]   (one tiny shape, one round: a check of the code path)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from transformer import losses

REPO = Path(__file__).resolve().parents[2]

PAD, EPS = 0, 0.1
LossFn = Callable[[Tensor, Tensor], Tensor]


def losses_at(revision: str) -> object:
    """transformer/losses.py as it was at git `revision`, imported on its own (it imports only torch), so the
    baseline loads whatever layout the rest of the package had then."""
    source = subprocess.run(
        ["git", "show", f"{revision}:transformer/losses.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="bench_loss_")) / "losses_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ours(module: object) -> LossFn:
    loss = module.label_smoothed_cross_entropy  # type: ignore[attr-defined]
    return lambda logits, target: loss(logits, target, label_smoothing=EPS).loss


class _Chunked:
    """Ours with `_CHUNK_ELEMENTS` = 2**log2_elements from `__enter__` to `__exit__`, forward and backward."""

    def __init__(self, log2_elements: int) -> None:
        self.elements = 1 << log2_elements

    def __call__(self, logits: Tensor, target: Tensor) -> Tensor:
        return losses.label_smoothed_cross_entropy(logits, target, label_smoothing=EPS).loss

    def __enter__(self) -> None:
        self.default, losses._CHUNK_ELEMENTS = losses._CHUNK_ELEMENTS, self.elements

    def __exit__(self, *_: object) -> None:
        losses._CHUNK_ELEMENTS = self.default


def _setting(fn: LossFn) -> AbstractContextManager:
    """The chunk size a `_Chunked` implementation runs with; nothing for the others."""
    return fn if isinstance(fn, _Chunked) else nullcontext()


def _torch(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.float(), target, ignore_index=PAD, label_smoothing=EPS)


def _inputs(n: int, vocab: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=generator).mul_(3).to(dtype).requires_grad_()  # (N, V)
    target = torch.randint(1, vocab, (n,), generator=generator)
    target[::7] = PAD  # some padding
    return logits, target


def _step(fn: LossFn, logits: Tensor, target: Tensor) -> float:
    logits.grad = None
    with _setting(fn):
        start = time.perf_counter()
        fn(logits, target).backward()
        return time.perf_counter() - start


def saved_bytes(fn: LossFn, logits: Tensor, target: Tensor) -> tuple[int, int]:
    """(all, extra) bytes autograd saves in the forward; extra leaves out storages shared with the logits."""
    saved: list[Tensor] = []
    with _setting(fn), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(logits, target)
    storages = {}
    for t in saved:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    total = sum(storages.values())
    return total, total - storages.get(logits.untyped_storage().data_ptr(), 0)


def peak_bytes(fn: LossFn, logits: Tensor, target: Tensor) -> int:
    """Peak CPU bytes allocated during forward + backward above what was allocated before."""
    logits.grad = None
    with _setting(fn), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(logits, target).backward()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            events.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
    events.sort()
    if not events:
        return 0
    before = events[0][2] - events[0][1]
    return max(total for _, _, total in events) - before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 81145c1: the last revision whose loss kept float32 log-probabilities for the backward pass
    parser.add_argument("--baseline", default="81145c1", help="git revision of the 'before' implementation")
    parser.add_argument("--shapes", default="2688x10000,4096x32000", help="comma-separated NxV")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--chunks", default="", help="comma-separated log2 chunk sizes to add as ours@2^k")
    parser.add_argument("--smoke", action="store_true", help="one tiny shape (64x100), one round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.repeats = "64x100", 1
    if args.threads:
        torch.set_num_threads(args.threads)
    fns = {"ours": _ours(losses), "before": _ours(losses_at(args.baseline)), "torch": _torch}
    for k in filter(None, args.chunks.split(",")):
        fns[f"ours@2^{k}"] = _Chunked(int(k))

    results = []
    for shape in args.shapes.split(","):
        n, vocab = (int(x) for x in shape.split("x"))
        for dtype in (torch.float32, torch.bfloat16):
            logits, target = _inputs(n, vocab, dtype)
            times: dict[str, list[float]] = {name: [] for name in fns}
            for i in range(args.repeats + 1):  # the first round warms up
                order = list(fns) if i % 2 == 0 else list(reversed(fns))
                for name in order:
                    seconds = _step(fns[name], logits, target)
                    if i:
                        times[name].append(seconds)
            for name, fn in fns.items():
                saved, extra = saved_bytes(fn, logits, target)
                row = {
                    "shape": shape,
                    "dtype": str(dtype).removeprefix("torch."),
                    "impl": name,
                    "ms": 1e3 * statistics.median(times[name]),
                    "saved_MB": saved / 2**20,
                    "extra_saved_MB": extra / 2**20,
                    "peak_MB": peak_bytes(fn, logits, target) / 2**20,
                }
                results.append(row)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, baseline {args.baseline}")
    print(f"{'N x V':>12} {'dtype':>9} {'impl':>9} {'fwd+bwd ms':>11} {'saved MB':>9} {'extra MB':>9} "
          f"{'peak MB':>8} {'time vs before':>15}")  # fmt: skip
    for row in results:
        key = (row["shape"], row["dtype"])
        before = next(r for r in results if r["impl"] == "before" and (r["shape"], r["dtype"]) == key)
        print(
            f"{row['shape']:>12} {row['dtype']:>9} {row['impl']:>9} {row['ms']:11.1f} {row['saved_MB']:9.1f} "
            f"{row['extra_saved_MB']:9.1f} {row['peak_MB']:8.1f} {row['ms'] / before['ms']:15.3f}"
        )
    rounded = [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in results]
    print(json.dumps(rounded))


if __name__ == "__main__":
    main()
