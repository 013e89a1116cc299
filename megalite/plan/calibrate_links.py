"""The collective sweep of `--calibrate` (megalite/plan/calibrate.py): bus bandwidth and latency of
the links within and across nodes, measured like nccl-tests on the process group of a launch.

Groups: ranks are numbered node by node (torchrun: `per_node` = LOCAL_WORLD_SIZE consecutive
ranks a node). An intra-node group of size g is g consecutive ranks of one node; an inter-node
group of size g is one rank on each of g nodes, the same local rank. Every group of a size runs
at once (each rank is in exactly one), as TP groups inside nodes and DP groups across nodes do
in training, so a shared NIC or switch is shared here too. Per (op, size, bytes): one warm-up,
then `reps` calls timed after a barrier; the time is the slowest rank's mean.
"""
from __future__ import annotations

import time
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from megalite.plan.profile_file import OPS

# torch >= 2.12 renamed the tensor-based collectives (as megalite/parallel/comm.py)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth / algorithm bandwidth for an op over n ranks (algorithm
    bandwidth = bytes / seconds, bytes = the full buffer: all-gather's output, reduce-scatter's
    input)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"op={op!r}: must be one of {', '.join(OPS)}")


def fit_link(entries: Sequence[dict]) -> Dict[str, float]:
    """latency_s + bus_bytes / (bus_gbps·1e9), least squares of the relative error over sweep
    entries (bus bytes = bytes x bus_factor): each size counts alike, as training sends
    collectives of every size (TP's small ones, DP's bucket-sized ones), where a plain fit of
    the seconds would follow the largest message and misplace the small ones' time. A fitted
    latency below 0 (noise) becomes 0 with the line refitted through the origin; a fit that
    does not rise with size falls back to the best measured bus bandwidth."""
    xs = [e["bytes"] * bus_factor(e["op"], e["group_size"]) for e in entries]
    ys = [e["seconds"] for e in entries]
    ws = [1 / y ** 2 for y in ys]  # relative error: (fit - y) / y
    total = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / total
    my = sum(w * y for w, y in zip(ws, ys)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx \
        if sxx > 0 else 0.0
    latency = my - slope * mx
    if latency < 0:
        latency = 0.0
        slope = sum(w * x * y for w, x, y in zip(ws, xs, ys)) \
            / sum(w * x * x for w, x in zip(ws, xs))
    if slope <= 0:
        return {"bus_gbps": max(e["bus_gbps"] for e in entries), "latency_s": max(latency, 0.0)}
    return {"bus_gbps": 1 / slope / 1e9, "latency_s": latency}


def fit_ops(entries: Sequence[dict]) -> Dict[str, Dict[str, float]]:
    """`fit_link` per collective kind (all-reduce, all-gather, reduce-scatter, send/recv) that
    was measured at two sizes or more: small-message latencies differ by kind (a ring
    all-reduce is a reduce-scatter and an all-gather; gloo's kinds differ more)."""
    out = {}
    for op in OPS:
        mine = [e for e in entries if e["op"] == op]
        if len({e["bytes"] for e in mine}) >= 2:
            out[op] = fit_link(mine)
    return out


def group_sizes(n: int) -> List[int]:
    """The powers of two from 2 that divide n, and n itself; none for n < 2."""
    sizes = {g for g in (2 ** i for i in range(1, n.bit_length())) if n % g == 0}
    return sorted(sizes | ({n} if n >= 2 else set()))


def intra_node_groups(world: int, per_node: int, g: int) -> List[List[int]]:
    return [[node * per_node + c * g + i for i in range(g)]
            for node in range(world // per_node) for c in range(per_node // g)]


def inter_node_groups(world: int, per_node: int, g: int) -> List[List[int]]:
    nodes = world // per_node
    return [[(c * g + j) * per_node + local for j in range(g)]
            for local in range(per_node) for c in range(nodes // g)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(op: str, full: torch.Tensor, shard: torch.Tensor, recv: torch.Tensor, group,
         ranks: List[int]) -> None:
    if op == "all_reduce":
        dist.all_reduce(full, group=group)
    elif op == "all_gather":
        _all_gather_single(full, shard, group=group)
    elif op == "reduce_scatter":
        _reduce_scatter_single(shard, full, group=group)
    else:  # send/recv around the ring of the group: each rank sends to the next, at once
        i = ranks.index(dist.get_rank())
        works = [dist.isend(full, ranks[(i + 1) % len(ranks)], group=group),
                 dist.irecv(recv, ranks[(i - 1) % len(ranks)], group=group)]
        for w in works:
            w.wait()


def time_op(op: str, nbytes: int, group, ranks: List[int], device: torch.device,
            reps: int) -> dict:
    """One sweep entry: `op` over this rank's group, every group of the size at once."""
    n = len(ranks)
    numel = max(n, nbytes // 4 // n * n)  # fp32, divisible by the group
    full = torch.ones(numel, device=device)
    shard, recv = torch.ones(numel // n, device=device), torch.empty_like(full)
    _run(op, full, shard, recv, group, ranks)  # warm-up (connections, algorithm choice)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        _run(op, full, shard, recv, group, ranks)
    _sync(device)
    slowest = torch.tensor([(time.perf_counter() - t0) / reps], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds, nbytes = slowest.item(), numel * 4
    return {"op": op, "group_size": n, "bytes": nbytes, "seconds": seconds,
            "bus_gbps": nbytes * bus_factor(op, n) / seconds / 1e9}


def sweep_link(link: str, per_node: int, sizes: Sequence[int], device: torch.device,
               reps: int) -> List[dict]:
    """Sweep entries (tagged with `link`) for every group size of the link: intra_node over
    the ranks of a node, inter_node over the nodes. Every rank calls this (group creation is
    collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if link == "intra_node":
        sizes_g, make = group_sizes(per_node), intra_node_groups
    else:
        sizes_g, make = group_sizes(world // per_node), inter_node_groups
    entries = []
    for g in sizes_g:
        groups = make(world, per_node, g)
        mine = next(r for r in groups if rank in r)
        group, _ = dist.new_subgroups_by_enumeration(groups)
        for op in OPS:
            for nbytes in sizes:
                entries.append({"link": link, **time_op(op, nbytes, group, mine, device, reps)})
    return entries
