"""The rank grid: the one place where a global rank becomes (tp, pp, dp) coordinates.

    rank = tp_rank + tp * (pp_rank + pp * dp_rank)          # [TP, PP, DP], TP innermost

so the TP group of a rank is a run of consecutive ranks (inside one node), PP spans nearby nodes
and DP is outermost (Llama 3's network-aware order). Every group is a slice of the grid
[dp, pp, tp] of ranks. The `Topology` is created once after
`init_process_group` and passed explicitly to everything that communicates; nothing reads groups
from module globals.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from megalite.parallel.group import CollectiveWaits, CommCounter, Group


@dataclass(frozen=True)
class Coords:
    """One rank's place in the grid (the sizes are the `Layout`'s / `Topology`'s)."""

    tp_rank: int
    pp_rank: int
    dp_rank: int


def rank_of(coords: Coords, tp: int, pp: int) -> int:
    return coords.tp_rank + tp * (coords.pp_rank + pp * coords.dp_rank)


def coords_of(rank: int, tp: int, pp: int) -> Coords:
    return Coords(tp_rank=rank % tp, pp_rank=(rank // tp) % pp, dp_rank=rank // (tp * pp))


def group_ranks(tp: int, pp: int, dp: int) -> Dict[str, List[List[int]]]:
    """All rank lists of every group kind, derived from one grid of shape [dp, pp, tp].

    tp: ranks sharing (pp, dp); pp: sharing (tp, dp); dp: sharing (tp, pp);
    mp (model parallel = TP x PP, one model replica): sharing dp;
    embedding: first and last pipeline stage of each (tp, dp) (just the stage when pp = 1).
    """
    def grid(t: int, p: int, d: int) -> int:
        return rank_of(Coords(t, p, d), tp, pp)

    out: Dict[str, List[List[int]]] = {
        "tp": [[grid(t, p, d) for t in range(tp)] for d in range(dp) for p in range(pp)],
        "pp": [[grid(t, p, d) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "dp": [[grid(t, p, d) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "mp": [[grid(t, p, d) for p in range(pp) for t in range(tp)] for d in range(dp)],
    }
    out["embedding"] = [sorted({r[0], r[-1]}) for r in out["pp"]]
    return out


@dataclass
class Topology:
    """Sizes, this rank's coordinates and its process groups (`Group` handles)."""

    tp_size: int
    pp_size: int
    dp_size: int
    rank: int
    counter: CommCounter = field(default_factory=CommCounter)
    groups: Dict[str, Group] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def coords(self) -> Coords:
        return coords_of(self.rank, self.tp_size, self.pp_size)

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp_rank == self.pp_size - 1

    @property
    def tp_group(self) -> Group:
        return self.groups["tp"]

    @property
    def pp_group(self) -> Group:
        return self.groups["pp"]

    @property
    def dp_group(self) -> Group:
        return self.groups["dp"]

    @property
    def mp_group(self) -> Group:
        return self.groups["mp"]

    @property
    def embedding_group(self) -> Group:
        """The tied embedding's copies: the first and the last pipeline stage of this rank's
        (tp, dp) line. A middle stage of a pp >= 3 run is in none (`in_group`): asking it
        for one is a bug, named as such."""
        return self.group("embedding")

    def in_group(self, kind: str) -> bool:
        """Whether this rank is a member of a group of `kind` (every rank is in one of each
        kind but "embedding", which holds the first and last stage only)."""
        return kind in self.groups

    def group(self, kind: str) -> Group:
        if kind not in self.groups:
            raise KeyError(f"{self.describe()} is in no {kind!r} group (members: "
                           f"{', '.join(sorted(self.groups))}); ask `in_group` first")
        return self.groups[kind]

    @property
    def world_group(self) -> Group:
        """Every rank, over the default process group (no communicator of its own)."""
        return self.groups["world"]

    @property
    def checkpoint_group(self) -> Group:
        """All ranks, over gloo, with the checkpoint protocol's own timeout
        (`checkpoint.timeout_s`): every collective of a save (in the training thread or the
        background) and of a resume runs on it, so slow storage never trips the timeout (or
        NCCL's watchdog) of the training groups."""
        return self.groups["checkpoint"]

    def describe(self) -> str:
        c = self.coords
        return (f"rank {self.rank}/{self.world_size} tp={c.tp_rank}/{self.tp_size} "
                f"pp={c.pp_rank}/{self.pp_size} dp={c.dp_rank}/{self.dp_size}")


def build_topology(tp: int, pp: int, dp: int, rank: Optional[int] = None,
                   timeout_s: Optional[float] = None,
                   checkpoint_timeout_s: Optional[float] = None,
                   waits: Optional[CollectiveWaits] = None,
                   flight: Optional[object] = None, alone: bool = False) -> Topology:
    """Create every process group of the grid; works without torch.distributed at world size 1.
    Its calls are counted in one `CommCounter`, which times them in `waits` and reports them
    to the flight recorder `flight` where given (`megalite.parallel.group`); the checkpoint
    group's calls in a counter of their own, reported to `flight` too.

    `dist.new_group` is collective over the whole world, so every rank creates every group in
    the same order and keeps the handles of the groups it belongs to. The checkpoint group is a
    gloo group of all ranks with `checkpoint_timeout_s` (a separate communicator, so a
    background save's collectives cannot interleave with the training thread's).

    `alone`: a world of this process only (tp = pp = dp = 1) even inside a launched job, e.g.
    the serial reference one rank of `megalite-selftest` computes while the others wait: no
    process group is created or used.
    """
    world = tp * pp * dp
    if alone and world != 1:
        raise ValueError(f"alone: a world of one process, not tp*pp*dp = {tp}*{pp}*{dp}")
    initialized = not alone and dist.is_available() and dist.is_initialized()
    if initialized and dist.get_world_size() != world:
        raise ValueError(f"world size {dist.get_world_size()} != tp*pp*dp = {tp}*{pp}*{dp}")
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if not initialized and world != 1:
        raise RuntimeError("torch.distributed must be initialized for world size > 1")
    topo = Topology(tp_size=tp, pp_size=pp, dp_size=dp, rank=rank,
                    counter=CommCounter(waits=waits, flight=flight))
    named = _names_groups()
    for kind, rank_lists in group_ranks(tp, pp, dp).items():
        mine: Optional[Tuple[List[int], Optional[dist.ProcessGroup]]] = None
        for ranks in rank_lists:
            pg = None
            if initialized and len(ranks) > 1:
                pg = _new_group(ranks, kind, timeout_s, named=named)
            if rank in ranks:
                mine = (ranks, pg)
        if mine is not None:
            ranks, pg = mine
            topo.groups[kind] = Group(name=kind, ranks=ranks, rank=ranks.index(rank), pg=pg,
                                      counter=topo.counter)
    topo.groups["world"] = Group(name="world", ranks=list(range(world)), rank=rank, pg=None,
                                 counter=topo.counter)
    pg = _new_group(list(range(world)), "checkpoint", checkpoint_timeout_s or timeout_s,
                    backend=_host_backend(), named=named) if initialized and world > 1 else None
    # its own counter: a background save's traffic is not the training steps' (metrics)
    topo.groups["checkpoint"] = Group(name="checkpoint", ranks=list(range(world)), rank=rank,
                                      pg=pg, counter=CommCounter(flight=flight))
    return topo


def _names_groups() -> bool:
    """Whether this torch's `dist.new_group` takes `group_desc` (torch >= 2.4). Asked once per
    topology, not per group: a 4,096-rank grid creates ~6,000 groups, and asking each time
    was 40% of `build_topology`'s CPU time there (0.1 of 0.25 s)."""
    return "group_desc" in inspect.signature(dist.new_group).parameters


def _host_backend() -> str:
    """The checkpoint group's backend: gloo (CPU tensors beside NCCL's), except under PyTorch's
    fake backend (`megalite.cli.verify_rank`), which simulates every group and has no store that
    a real gloo group could rendezvous on."""
    return "fake" if dist.get_backend() == "fake" else "gloo"


def _new_group(ranks: List[int], name: str, timeout_s: Optional[float],
               backend: Optional[str] = None, named: bool = False) -> dist.ProcessGroup:
    """`dist.new_group`, named where torch can (`named`: `group_desc`, torch >= 2.4): NCCL
    reports a timed-out or failed collective from its watchdog thread, which names the group
    by this."""
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    if named:
        kwargs["group_desc"] = name
    return dist.new_group(ranks, backend=backend, **kwargs)
