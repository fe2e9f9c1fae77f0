"""The machine a benchmark ran on: the CPU's model, and the data-sheet bf16 peak of GPUs (for MFU)."""

from __future__ import annotations

import os
import platform
import subprocess

# dense bf16 tensor-core peak, TFLOP/s, from each GPU's data sheet (the key: part of its torch device name)
GPU_BF16_PEAK_TFLOPS = {
    "H100 80GB HBM3": 989.4,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.4,
    "A100": 312.0,
    "L40S": 362.1,
    "L4": 121.0,
    "A10G": 125.0,
}


def gpu_bf16_peak_tflops(name: str) -> float | None:
    """The data-sheet bf16 peak of the GPU named `name` (torch.cuda.get_device_name()), None if unknown."""
    return next((tflops for key, tflops in GPU_BF16_PEAK_TFLOPS.items() if key in name), None)


def cpu_name() -> str:
    """This machine's CPU model (lscpu) and core count."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or 'cpu'}, {os.cpu_count()} cores"
