"""Host threads for offload.optimizer's CPU AdamW. torchrun sets OMP_NUM_THREADS=1 for every
rank it starts (unless the user set it), so PyTorch's CPU kernels — the host AdamW, the host
gradient norm and sums — would run on one core while the node's other cores idle: the fused
CPU AdamW scales about linearly with threads until memory bandwidth runs out. With
offload.optimizer > 0 on CUDA each rank takes its share of the cores it may run on:
len(os.sched_getaffinity(0)) // LOCAL_WORLD_SIZE (at least 1), never fewer than it already has.

On CPU the device work itself runs on the intra-op threads (`cpu_threads`): `cpu_threads=N`
or the user's OMP_NUM_THREADS where set; otherwise the cores this process may run on less those
the other processes keep busy (the 1-minute load average at start-up, rounded, at most all
but one core), shared among the node's LOCAL_WORLD_SIZE ranks, less one a rank for the
offload.optimizer worker thread (it steps the host AdamW beside the compute), at least 1.
torch's default (every core) runs OpenMP teams that spin at each barrier while other processes
hold the cores: on a loaded 2-core machine 1 thread ran a quickstart step 2-10x faster
(docs/benchmarks.md#cpu-threads)."""
from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple

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


def cpu_thread_choice(setting: Optional[int], env: Mapping[str, str], cores: int, load: float,
                      local_ranks: int, offload_worker: bool) -> Tuple[Optional[int], str]:
    """(intra-op threads for a CPU rank, or None to keep torch's; why), by the rule of the
    module docstring: `setting` (cpu_threads), then OMP_NUM_THREADS in `env`, then the
    `cores` the others' `load` leaves, per local rank, less the offload worker's."""
    if setting is not None:
        return setting, f"cpu_threads={setting}"
    if env.get("OMP_NUM_THREADS"):
        return None, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
    busy = min(max(round(load), 0), cores - 1)
    threads = max((cores - busy) // max(local_ranks, 1) - int(offload_worker), 1)
    return threads, (f"{cores} cores, load {load:.1f}, {local_ranks} local rank"
                     f"{'s' if local_ranks != 1 else ''}"
                     f"{', an offload worker each' if offload_worker else ''}")


def set_cpu_threads(setting: Optional[int], offload_fraction: float, device: torch.device,
                    local_ranks: Optional[int] = None) -> Optional[int]:
    """On a CPU device: torch.set_num_threads by `cpu_thread_choice` (a change logged, with
    how to choose otherwise). Returns the count set, None where it kept the current one."""
    if device.type != "cpu":
        return None
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads, why = cpu_thread_choice(setting, os.environ, cores_available(), os.getloadavg()[0],
                                     local_ranks, offload_fraction > 0)
    current = torch.get_num_threads()
    if threads is None or threads == current:  # said at debug level: a self-test builds often
        get_logger().debug(f"CPU: {current} intra-op threads ({why})")
        return None
    torch.set_num_threads(threads)
    get_logger().info(f"CPU: {threads} intra-op threads, was {current} ({why}; set "
                      "cpu_threads=N or OMP_NUM_THREADS to choose)")
    return threads
