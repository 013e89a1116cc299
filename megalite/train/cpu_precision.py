"""What bf16 (or fp16) costs on a CPU, said once at start-up.

On a GPU, bf16 is the fast path; on a CPU it is fast only where the CPU has bf16 instructions
(AVX512-BF16, AMX) and is converted in software elsewhere, and either way the model computes
with an 8-bit mantissa. `half_precision_note` times one square matmul of the model's width in
the run's precision against fp32 on this CPU (a few milliseconds) and says the ratio measured.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from megalite.config.layout import PRECISION_DTYPES

REPEATS = 5  # the fastest of these is the time (the first warms the kernel up)


def matmul_seconds(n: int, dtype: torch.dtype) -> float:
    """The fastest of REPEATS n×n matmuls in `dtype` on the CPU."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def half_precision_note(precision: str, device_type: str, width: int) -> Optional[str]:
    """The start-up note of a CPU run in bf16/fp16 (None for any other run)."""
    if device_type != "cpu" or precision not in ("bf16", "fp16"):
        return None
    n = max(256, min(width, 1024))
    half = matmul_seconds(n, PRECISION_DTYPES[precision])
    full = matmul_seconds(n, torch.float32)
    ratio = half / full
    cost = (f"{ratio:.1f}x the time of fp32's" if ratio >= 1.05 else
            f"{1 / ratio:.1f}x faster than fp32 (this CPU has {precision} instructions)"
            if ratio <= 0.95 else "about fp32's time")
    return (f"precision={precision} on a CPU: a {n}x{n} matmul here takes {cost} "
            f"({half * 1e3:.2f} ms against {full * 1e3:.2f} ms), and the model computes with "
            f"{precision}'s rounding, so losses differ from fp32's; precision=auto (fp32 on a "
            "CPU) is the CPU's default")
