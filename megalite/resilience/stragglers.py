"""Straggler reports (`resilience.straggler_report_every=N`): which rank holds the others back.

Every rank measures the compute time of each step phase (`megalite.train.timers`: data,
forward_backward, grad_sync, optimizer, and their sum, "step"; the trainer hands them in),
that is the phase's time less the time the rank spent inside collectives during it
(`megalite.parallel.group.CollectiveWaits`). A slow rank makes every peer of its TP, PP and
DP groups wait in their collectives, so their phases grow as much as its own; their compute
does not. Every N steps the per-step means over the window are gathered (one all_gather of a
few fp64 per rank) and each rank is compared with its peers, the ranks doing the same work:
those of its pipeline stage (its TP and DP ranks). Stages differ in work (the first holds
the embeddings, the last the LM head and the loss), so they are not compared with each
other: with tp = dp = 1 a rank has no peer, and the report gives the compute times but can
name nobody.

A rank is named when, in a phase, its compute per step is at least `straggler_factor` times
the lower median of its peers *and* exceeds it by at least `straggler_min_s` seconds (a
relative and an absolute floor: a phase of a millisecond may double without mattering). The
lower median (of an even count the lower middle value) makes two peers compare the slower
with the faster. Rank 0 logs each straggler (rank, host, GPU index, phase, seconds) and the
metrics line of the step carries the report (`straggler_report` in metrics.jsonl: the window's
steps, the stragglers, and each phase's lower median over all ranks; `perf/stragglers` in
wandb), so the node can be excluded from the next launch.
"""
from __future__ import annotations

import socket
import statistics
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import torch

from megalite.parallel import comm
from megalite.parallel.topology import Topology, coords_of
from megalite.utils.log import get_logger

TOTAL = "step"  # the column of the phases' sum


@dataclass
class Straggler:
    rank: int
    host: str
    gpu: Optional[int]  # the CUDA device index on its node; None on CPU
    phase: str
    compute_s: float  # per step, over the window
    median_s: float  # the lower median of its peers (itself included)


def find_slow(compute: Sequence[Sequence[float]], peers: Sequence[Sequence[int]],
              factor: float, min_s: float) -> List[tuple]:
    """(rank, column, seconds, median) of every rank slower than its peers: `compute[r][k]`
    is rank r's seconds per step in column k; `peers` lists the groups compared within."""
    slow = []
    for ranks in peers:
        for k in range(len(compute[ranks[0]])):
            median = statistics.median_low([compute[r][k] for r in ranks])
            for r in ranks:
                value = compute[r][k]
                if value > median and value >= factor * median and value - median >= min_s:
                    slow.append((r, k, value, median))
    return slow


def peer_groups(topo: Topology) -> List[List[int]]:
    """Ranks that do the same work: one group per pipeline stage (none when each stage has a
    single rank)."""
    if topo.tp_size * topo.cp_size * topo.dp_size == 1:
        return []
    return [[r for r in range(topo.world_size)
             if coords_of(r, topo.tp_size, topo.pp_size, topo.cp_size, topo.dp_size,
                                topo.rank_order).pp_rank == stage]
            for stage in range(topo.pp_size)]


def where_this_rank_runs(device: torch.device) -> tuple:
    """(host name, CUDA device index or None)."""
    return socket.gethostname(), device.index if device.type == "cuda" else None


class StragglerReport:
    """Straggler reports of one rank (collective: every rank calls `report` at the same
    steps, with the same phases)."""

    def __init__(self, topo: Topology, device: torch.device, every: int, factor: float,
                 min_s: float):
        self.topo, self.device = topo, device
        self.every, self.factor, self.min_s = every, factor, min_s
        # where every rank runs, on rank 0 (gathered once)
        self.places = comm.gather_objects_to_root(where_this_rank_runs(device),
                                                  topo.world_group)
        self.window_start = 0  # the step after which the current window began
        if topo.rank == 0 and not peer_groups(topo):
            get_logger().info("straggler reports compare the ranks of a pipeline "
                              "stage, and each stage has one rank here (tp = dp = 1): they "
                              "give compute times but name no straggler")

    def start(self, step: int) -> None:
        """Begin a window after `step`."""
        self.window_start = step

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def report(self, step: int, compute: Dict[str, float]) -> Optional[dict]:
        """Gather the window's compute seconds (`compute`: this rank's, by phase, summed over
        the window's steps); rank 0 returns the report (and logs the stragglers), the other
        ranks None."""
        steps = max(1, step - self.window_start)
        columns = [*compute, TOTAL]
        values = [seconds / steps for seconds in compute.values()]
        mine = torch.tensor(values + [sum(values)], dtype=torch.float64, device=self.device)
        world = self.topo.world_group
        gathered = torch.empty(world.size * mine.numel(), dtype=torch.float64,
                               device=self.device)
        comm.all_gather(gathered, mine, world)
        first, self.window_start = self.window_start + 1, step
        if self.topo.rank != 0:
            return None
        table = gathered.view(world.size, -1).tolist()
        stragglers = [Straggler(r, *self.places[r], columns[k], value, median)
                      for r, k, value, median in find_slow(table, peer_groups(self.topo),
                                                           self.factor, self.min_s)]
        for s in stragglers:
            gpu = "" if s.gpu is None else f", GPU {s.gpu}"
            get_logger().warning(
                f"straggler: rank {s.rank} (host {s.host}{gpu}) computed "
                f"{s.compute_s:.3f} s per step in {s.phase} over steps {first}-{step}, "
                f"{s.compute_s / s.median_s if s.median_s else float('inf'):.2f}x the "
                f"{s.median_s:.3f} s of its peers (resilience.straggler_factor={self.factor}, "
                f"straggler_min_s={self.min_s}); a persistently slow node can be excluded "
                "from the next launch")
        medians = {name: statistics.median_low([row[k] for row in table])
                   for k, name in enumerate(columns)}
        return {"steps": [first, step], "median_compute_s": medians,
                "stragglers": [asdict(s) for s in stragglers]}
