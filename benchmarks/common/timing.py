"""How the benchmarks time: interleaved rounds (the order rotates), paired ratios of their times, and CPU
time of paired rounds (the decoding A/Bs)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def timed(method: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(seconds, output) of one call, on a GPU from an idle device to the end of its last kernel."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    output = method()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, output


def interleaved(
    methods: dict[str, Callable[[], Any]],
    repeats: int,
    device: torch.device = torch.device("cpu"),  # noqa: B008
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Seconds of each method in each of `repeats` rounds (the order rotates), and its last output;
    on a GPU each call is timed from an idle device to the end of its last kernel (`timed`)."""
    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, Any] = {}
    for i in range(repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, outputs[name] = timed(methods[name], device)
            times[name].append(seconds)
    return times, outputs


def paired_ratio(times: dict[str, list[float]], faster: str, slower: str) -> float:
    """Median over rounds of slower/faster time: each round's pair ran minutes apart at most, so a
    change of load between rounds cancels out."""
    return statistics.median(s / f for f, s in zip(times[faster], times[slower]))


def cpu_seconds(run: Callable[[], object]) -> float:
    """CPU time (`time.process_time`) of one call: other jobs on a shared machine disturb it less."""
    start = time.process_time()
    run()
    return time.process_time() - start


def paired_cpu_seconds(
    first: Callable[[], object], second: Callable[[], object], rounds: int
) -> tuple[float, float, list[float]]:
    """Median CPU seconds of `first` and `second` over interleaved rounds (the order alternates), and
    second / first per round."""
    times: dict[str, list[float]] = {"first": [], "second": []}
    for r in range(rounds):
        order = (
            [("first", first), ("second", second)] if r % 2 == 0 else [("second", second), ("first", first)]
        )
        for key, run in order:
            times[key].append(cpu_seconds(run))
    ratios = [b / a for a, b in zip(times["first"], times["second"])]
    return statistics.median(times["first"]), statistics.median(times["second"]), ratios
