"""The self-test's link check (`megalite-selftest`): each link the launch's groups use — inside
a node, across nodes — measured with the calibration's sweep (`megalite.plan.calibrate_links`:
all-reduce, all-gather, reduce-scatter, send/recv over the widest group of the link, every
group of that size at once) and fitted to bus bandwidth and latency, then held against the
device table's figure (`megalite.plan.devices`).

The rule, stated in the report:

- On CUDA (NCCL) the link passes when its fitted bus bandwidth is at least 1/`FACTOR` of the
  table's (a broken NVLink falls back to PCIe, ~10x slower; an inter-node link that lost
  InfiniBand falls back to TCP sockets, ~10-20x) and its fitted latency at most `FACTOR`x the
  table's plus `LATENCY_SLACK_S`; a device the table does not know is measured and reported,
  not judged.
- On CPU (gloo) there is no hardware link to judge: the table's `cpu` entry is a rough
  single-core loopback figure and the ranks share the cores, so the check passes when every
  collective of the sweep completed (within `parallel.timeout_s`) and gave a positive, finite
  fit; the ratio to the `cpu` entry is reported, not judged.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist

from megalite.plan.calibrate_links import (
    fit_link,
    inter_node_groups,
    intra_node_groups,
    time_op,
)
from megalite.plan.devices import BY_NAME, DeviceProfile, table_entry_for
from megalite.plan.profile_file import OPS

FACTOR = 2.0  # CUDA: within this factor of the table's bus bandwidth (and latency)
LATENCY_SLACK_S = 50e-6  # CUDA: small-message latency fits are noisy at the tens of µs
CUDA_SIZES = (1 << 20, 16 << 20, 128 << 20)
CPU_SIZES = (64 << 10, 1 << 20)
REPS = 3


def table_for(device: torch.device) -> Optional[DeviceProfile]:
    """The device table's entry for this launch's device (None: a GPU it does not know)."""
    if device.type != "cuda":
        return BY_NAME["cpu"]
    props = torch.cuda.get_device_properties(device)
    return table_entry_for(props.name, props.total_memory)


def measure_link(link: str, per_node: int, device: torch.device) -> List[dict]:
    """Sweep entries of `link` ("intra_node": groups of the ranks of a node; "inter_node":
    one rank per node) over its widest groups. Collective: every rank calls it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if link == "intra_node":
        groups = intra_node_groups(world, per_node, per_node)
    else:
        groups = inter_node_groups(world, per_node, world // per_node)
    mine = next(g for g in groups if rank in g)
    group, _ = dist.new_subgroups_by_enumeration(groups)
    sizes = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    entries = [{"link": link, **time_op(op, nbytes, group, mine, device, REPS)}
               for op in OPS for nbytes in sizes]
    return entries


def judge(link: str, entries: List[dict], device: torch.device,
          table: Optional[DeviceProfile]) -> dict:
    """The check of one link: the fit, the table's figure, passed or not, and the rule."""
    fit = fit_link(entries)
    gbps, latency = fit["bus_gbps"], fit["latency_s"]
    sane = all(math.isfinite(x) for x in (gbps, latency)) and gbps > 0 and latency >= 0
    widest = max(e["group_size"] for e in entries)
    out = {"link": link, "group_size": widest, "bus_gbps": gbps, "latency_s": latency,
           "sweep": entries}
    if table is None:
        return {**out, "passed": sane, "table": None,
                "rule": "measured and reported: the device table has no entry for this GPU"}
    ref = getattr(table, link)
    out["table"] = {"name": table.name, "bus_gbps": ref.bus_gbps, "latency_s": ref.latency_s}
    out["ratio"] = gbps / ref.bus_gbps
    if device.type != "cuda":
        return {**out, "passed": sane,
                "rule": "CPU/gloo: every collective completed with a positive fit; the ratio "
                        f"to the table's rough '{table.name}' entry is reported, not judged"}
    ok = sane and gbps >= ref.bus_gbps / FACTOR and \
        latency <= FACTOR * ref.latency_s + LATENCY_SLACK_S
    return {**out, "passed": ok, "min_bus_gbps": ref.bus_gbps / FACTOR,
            "rule": f"bus bandwidth >= table / {FACTOR:g} ({ref.bus_gbps / FACTOR:.3g} GB/s) "
                    f"and latency <= {FACTOR:g} x table + {LATENCY_SLACK_S * 1e6:.0f} µs"}
