"""Host threads for offload.optimizer's CPU AdamW. torchrun sets OMP_NUM_THREADS=1 for every
rank it starts (unless the user set it), so PyTorch's CPU kernels — the host AdamW, the host
gradient norm and sums — would run on one core while the node's other cores idle: the fused
CPU AdamW scales about linearly with threads until memory bandwidth runs out. With
offload.optimizer > 0 on CUDA each rank takes its share of the cores it may run on:
len(os.sched_getaffinity(0)) // LOCAL_WORLD_SIZE (at least 1), never fewer than it already has.

On CPU nothing changes: there the "device" work runs on the same threads, which the launch
chose for the whole run (and offload saves nothing there)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from megalite.utils.log import get_logger


def cores_available() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def host_threads_per_rank(cores: int, local_ranks: int, current: int) -> int:
    """A rank's share of the node's `cores` among its `local_ranks`, at least 1 and not
    below the `current` thread count."""
    return max(current, cores // max(local_ranks, 1), 1)


def set_host_threads(offload_fraction: float, device: torch.device,
                     local_ranks: Optional[int] = None, cores: Optional[int] = None
                     ) -> Optional[int]:
    """torch.set_num_threads to this rank's share of the cores when the optimizer is
    offloaded on CUDA (`local_ranks`: LOCAL_WORLD_SIZE by default). Returns the new thread
    count, None where nothing changed."""
    if offload_fraction <= 0 or device.type != "cuda":
        return None
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    current = torch.get_num_threads()
    threads = host_threads_per_rank(cores_available() if cores is None else cores,
                                    local_ranks, current)
    if threads == current:
        return None
    torch.set_num_threads(threads)
    get_logger().info(f"offload.optimizer={offload_fraction:g}: host AdamW on "
                      f"{threads} threads per rank (was {current}; {local_ranks} local ranks)")
    return threads
