"""Where a training step's time goes: bench_gpu.py's eager training case under torch.profiler.

    python -m benchmarks.gpu.gpu_profile [--models ours,torch] [--no-cudnn-sdp] [--loss-chunk-elements N]
                                         [--smoke] [--results-dir DIR]

For each model: the step time over the bench's varying batches and over one batch repeated (does a new
shape cost?), then one profiled step: wall time, the GPU's busy time (the sum of its kernels), the number
of kernel launches, and the top operators by self GPU time and by self CPU time. A step whose GPU is busy
for a small part of its wall time is bound by the host (launches, Python), not by the kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common.shapes import SMOKE, WMT_BASE, wmt_batches
from benchmarks.gpu.training import build
from transformer import losses
from transformer.config import TransformerConfig


def profile_model(
    name: str, config: TransformerConfig, batches: list, device: torch.device, bf16: bool
) -> str:
    runner = build(name, config, device, "inductor")
    runner.autocast = torch.bfloat16 if bf16 else None
    for batch in batches[:3]:
        runner.step(batch)
    varying = [runner.step(batch) for batch in batches[3:]]
    same = [runner.step(batches[3]) for _ in range(5)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = runner.step(batches[3])
    events = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6  # us -> s (overlaps not removed)
    aten_ops = sum(e.count for e in events if e.key.startswith("aten::"))
    lines = [
        f"== {name}: step s over varying batches: median {statistics.median(varying):.4f} "
        f"(min {min(varying):.4f}, max {max(varying):.4f}); "
        f"one batch repeated: median {statistics.median(same):.4f}",
        f"profiled step: wall {wall:.4f} s, GPU kernels {len(kernels)}, GPU busy {busy:.4f} s "
        f"({100 * busy / wall:.0f}% of wall), aten ops {aten_ops}",
    ]
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    lines.append(events.table(sort_by=sort, row_limit=15, max_name_column_width=60))
    if device.type == "cuda":
        lines.append(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    del runner
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ours,torch")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, fp32, on the CPU")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--results-dir", default=None)
    parser.add_argument("--no-cudnn-sdp", action="store_true", help="SDPA without the cuDNN backend (A/B)")
    parser.add_argument(
        "--loss-chunk-elements", type=int, default=None, help="the loss's row chunk on CUDA (elements, A/B)"
    )
    args = parser.parse_args(argv)
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.loss_chunk_elements:
        losses._CHUNK_ELEMENTS_BY_DEVICE["cuda"] = args.loss_chunk_elements
    variant = f"cudnn_sdp={not args.no_cudnn_sdp} loss_chunk={losses._CHUNK_ELEMENTS_BY_DEVICE['cuda']}"
    device = torch.device("cpu" if args.smoke else "cuda")
    shape = SMOKE if args.smoke else WMT_BASE
    vocab, tokens = (1000, 300) if args.smoke else (32_000, 25_000)
    config = TransformerConfig(src_vocab_size=vocab, max_len=256, **shape)
    batches = [b.to(device) for b in wmt_batches(max(args.batches, 4), tokens, vocab)]
    out = []
    for name in args.models.split(","):
        text = f"[{variant}] " + profile_model(name, config, batches, device, bf16=not args.smoke)
        print(text, flush=True)
        out.append(text)
    if args.results_dir:
        with open(Path(args.results_dir, "gpu_profile.txt"), "a") as file:
            file.write("\n\n".join(out) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
