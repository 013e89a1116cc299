"""Host memory for offloaded state, checked before launch: what the ranks of one node would
hold in host memory against what the node has available. Per rank (the busiest pipeline
stage): the plan's `StagePlan.host` (offloaded optimizer state and pinned activation
buffers) + the async-checkpoint staging buffer (checkpoint.async_save: 12 bytes — fp32
master and two moments — per parameter element the rank writes, its DP share)."""
from __future__ import annotations

import os
from typing import Optional

from megalite.config.errors import fail
from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.plan.memory import GIB, Plan, make_plan


def available_host_bytes() -> Optional[int]:
    """Memory the node can still give: MemAvailable of /proc/meminfo (Linux), else the free
    physical pages; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_bytes_per_rank(plan: Plan, async_save: bool) -> float:
    """Host bytes one rank holds, counted as the busiest pipeline stage's."""
    dp = plan.layout["dp"]
    return max(s.host.get("total", 0.0) + (12 * s.params / dp if async_save else 0.0)
               for s in plan.stages)


def host_bytes_per_node(plan: Plan, local_ranks: int, async_save: bool = False) -> float:
    """Host bytes `local_ranks` ranks hold (LOCAL_WORLD_SIZE), each as the busiest stage."""
    return local_ranks * host_bytes_per_rank(plan, async_save)


def check_host_memory(cfg: Config, layout: Layout, local_ranks: int,
                      available: Optional[int] = None) -> None:
    """ConfigError when the offloaded state (offload.optimizer, offload.activations) with the
    async-checkpoint staging would not fit the node's available memory (`available` bytes;
    measured when None)."""
    if not cfg.offload.activations and not cfg.offload.optimizer:
        return
    plan = make_plan(cfg, layout)
    need = host_bytes_per_node(plan, local_ranks, cfg.checkpoint.async_save)
    have = available_host_bytes() if available is None else available
    if have is None or need <= have:
        return
    per_rank = need / local_ranks
    key, value = ("offload.optimizer", cfg.offload.optimizer) if cfg.offload.optimizer \
        else ("offload.activations", True)
    staging = " with the async-checkpoint staging" if cfg.checkpoint.async_save else ""
    fail(key, value,
         f"the {local_ranks} rank(s) of this node would hold about {need / GIB:.2f} GiB in "
         f"host memory ({per_rank / GIB:.2f} GiB per rank on the busiest pipeline stage: "
         f"offloaded state{staging}, megalite-plan's host column), more than the "
         f"{have / GIB:.2f} GiB available on this node; offload a smaller fraction "
         "(offload.optimizer), fewer blocks (offload.activations_layers=N, or recompute some "
         "with train.recompute_layers), lower train.micro_batch_size, raise zero / dp, or "
         "start fewer ranks per node")
