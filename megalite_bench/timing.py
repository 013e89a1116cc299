"""Timing helpers shared by the benchmarks."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def alternate(fns: Dict[str, Callable[[], object]], device: torch.device, warmup: int,
              steps: int) -> Dict[str, float]:
    """Median seconds per call of each function, calls interleaved (A B B A ...) so that
    machine noise hits every contender alike."""
    names = list(fns)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for i in range(warmup + steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            t = timed(fns[name], device)
            if i >= warmup:
                times[name].append(t)
    return {n: statistics.median(v) for n, v in times.items()}


def peak_memory(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
