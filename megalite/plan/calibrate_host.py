"""What `scripts/plan.py --calibrate` measures besides matmuls, links and a block: the rates of
the time model's memory-bound and offload terms (`megalite.plan.time_model`).

- `hbm_gbps` (CUDA): a device-to-device copy of `HBM_BYTES`, bytes read + written over its
  best time: what the loss, gradient accumulation, optimizer and dropout terms move at.
- `host_link` (CUDA): pinned host -> device and device -> host copies of `COPY_BYTES`, each
  direction alone, best of a few: activation and optimizer offload's copies.
- `host_adam`: PyTorch's CPU AdamW (fused where this PyTorch has it, as offload.optimizer
  uses: `megalite.parallel.host_range.host_adamw_kind`) over `ADAM_PARAMS` fp32 parameters, on
  the threads a rank of the node gets (its cores' share, as `megalite.train.host_threads`
  gives offload); the node's rate is the slowest rank's × the ranks of the node (all of them
  measure at once, as they would step). On CPU the host is the device: not measured.
"""
from __future__ import annotations

import math
import os
import time
from typing import Callable, Dict

import torch

from megalite.config.schema import OptimConfig
from megalite.parallel.host_range import build_adamw, host_adamw_kind

HBM_BYTES = 1 << 30  # copied per timing (read + written: twice that)
COPY_BYTES = 1 << 28  # 256 MiB each way
ADAM_PARAMS = 20_000_000  # as `scripts/bench.py offload` measures it


def best_seconds(fn: Callable[[], None], sync: Callable[[], None], timings: int = 5) -> float:
    """Best of `timings` calls of `fn` after a warm-up call, each synchronised."""
    fn()
    sync()
    best = math.inf
    for _ in range(timings):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_hbm_gbps(device: torch.device, nbytes: int = HBM_BYTES) -> float:
    """GB/s of a device-to-device copy: 2·nbytes (read and write) over its best time."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), lambda: torch.cuda.synchronize(device))
    return 2 * nbytes / seconds / 1e9


def measure_host_link(device: torch.device, nbytes: int = COPY_BYTES) -> Dict[str, float]:
    """{"h2d_gbps", "d2h_gbps"}: pinned host <-> device copies, one direction at a time."""
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True).fill_(1.0)
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device=device)

    def sync() -> None:
        torch.cuda.synchronize(device)
    h2d = best_seconds(lambda: dev.copy_(host, non_blocking=True), sync)
    d2h = best_seconds(lambda: host.copy_(dev, non_blocking=True), sync)
    return {"h2d_gbps": nbytes / h2d / 1e9, "d2h_gbps": nbytes / d2h / 1e9}


def rank_threads(local_ranks: int) -> int:
    """The host threads one of `local_ranks` ranks of a node gets (its cores' share)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def measure_host_adam(threads: int, numel: int = ADAM_PARAMS) -> Dict[str, object]:
    """{"params_per_s", "threads", "kind"}: one host AdamW step over `numel` fp32 parameters
    in 8 tensors on `threads` threads (torch's thread count put back after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kind = host_adamw_kind()
        params = [torch.nn.Parameter(torch.randn(numel // 8)) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = build_adamw(params, [True] * 8, OptimConfig(), kind)
        seconds = best_seconds(opt.step, lambda: None, timings=3)
    finally:
        torch.set_num_threads(before)
    return {"params_per_s": numel // 8 * 8 / seconds, "threads": threads, "kind": kind}
