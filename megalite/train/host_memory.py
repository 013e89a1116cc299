"""Host memory for offloaded state, checked before launch: what the ranks of one node would
hold in host memory (the plan's `StagePlan.host` per rank) against what the node has
available."""
from __future__ import annotations

import os
from typing import Optional

from megalite.config import Config, fail
from megalite.layout import Layout
from megalite.plan import GIB, Plan, make_plan


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


def host_bytes_per_node(plan: Plan, local_ranks: int) -> float:
    """Host bytes `local_ranks` ranks hold, each counted as the busiest pipeline stage."""
    return local_ranks * max(s.host.get("total", 0.0) for s in plan.stages)


def check_host_memory(cfg: Config, layout: Layout, local_ranks: int,
                      available: Optional[int] = None) -> None:
    """ConfigError when offloaded activations would not fit the node's available memory
    (`available` bytes; measured when None)."""
    if not cfg.offload.activations:
        return
    plan = make_plan(cfg, layout)
    need = host_bytes_per_node(plan, local_ranks)
    have = available_host_bytes() if available is None else available
    if have is None or need <= have:
        return
    per_rank = need / local_ranks
    fail("offload.activations", True,
         f"the {local_ranks} rank(s) of this node would hold about {need / GIB:.2f} GiB of "
         f"offloaded activations in host memory ({per_rank / GIB:.2f} GiB per rank on the "
         f"busiest pipeline stage, megalite-plan's host column), more than the "
         f"{have / GIB:.2f} GiB available on this node; offload fewer blocks "
         "(offload.activations_layers=N), recompute some (train.recompute_layers), lower "
         "train.micro_batch_size or start fewer ranks per node")
