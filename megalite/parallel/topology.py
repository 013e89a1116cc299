"""The rank grid: the one place where a global rank becomes (tp, cp, pp, dp) coordinates, in
one of two dense orders (`parallel.rank_order`, `RANK_ORDERS`):

    tp-cp-pp-dp: rank = tp_rank + tp * (cp_rank + cp * (pp_rank + pp * dp_rank))  # default
    tp-cp-dp-pp: rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))  # Megatron's

In both the TP group of a rank is a run of consecutive ranks (inside one node) and CP sits next
to it. tp-cp-pp-dp (Llama 3's network-aware order) puts PP next, on nearby nodes, and DP
outermost; tp-cp-dp-pp (Megatron-Core's default "tp-cp-ep-dp-pp") puts PP outermost, so the
tp·cp·dp ranks of one pipeline stage are consecutive and an expert-parallel group folded over
them stays inside a node while it fits one. cp = 1 is the [TP, PP, DP] (or [TP, DP, PP]) grid.
`strides` gives each coordinate's rank stride; every formula here derives from it. The CP
ranks of one (tp, pp, dp) hold the same parameters and see different tokens of the same
sequences, so gradients are reduced and ZeRO ranges split over DP x CP (the "dp_cp" group,
`grad_group`; Megatron's `with_context_parallel`).

Expert parallelism folds a second grid over the same world (Megatron-Core's "MoE parallel
folding", arXiv 2504.14960; torchtitan's sparse mesh): within each pipeline stage the
tp·cp·dp ranks, numbered by their dense coordinates, are regrouped into [EP, EDP] with EP
innermost (expert TP = 1), the PP groups unchanged:

    i    = tp_rank + tp * (cp_rank + cp * dp_rank)        # the rank's place in its stage
    i    = ep_rank + ep * edp_rank                         # [EP, EDP]
    rank = rank_of(tp_rank=i % tp, cp_rank=(i // tp) % cp, dp_rank=i // (tp * cp), pp_rank)

Under tp-cp-dp-pp that is rank = pp_rank·tp·cp·dp + i: an EP group is ep consecutive ranks.
The "ep" group (ranks sharing edp_rank and pp_rank) holds one copy of every expert, E/ep a
rank; the "edp" group (sharing ep_rank and pp_rank) holds the same experts and reduces their
gradients (as dp_cp does the dense ones). Listed only when ep > 1. The `Topology` is created once after
`init_process_group` and passed explicitly to everything that communicates; nothing reads groups
from module globals.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from megalite.config.schema import DEFAULT_RANK_ORDER, RANK_ORDERS
from megalite.parallel.group import CollectiveWaits, CommCounter, Group


@dataclass(frozen=True)
class Coords:
    """One rank's place in the grid (the sizes are the `Layout`'s / `Topology`'s)."""

    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int = 0


def strides(tp: int, cp: int, pp: int, dp: Optional[int], order: str = DEFAULT_RANK_ORDER
            ) -> Dict[str, int]:
    """The rank stride of each coordinate in the dense `order` (module docstring): rank =
    sum of coordinate x stride. `dp` may be None under tp-cp-pp-dp (DP outermost) only."""
    if order not in RANK_ORDERS:
        raise ValueError(f"rank order {order!r}: one of {', '.join(RANK_ORDERS)}")
    inner = tp * cp
    if order == "tp-cp-dp-pp":
        if dp is None:
            raise ValueError("rank order tp-cp-dp-pp (PP outermost) needs the dp size")
        return {"tp": 1, "cp": tp, "dp": inner, "pp": inner * dp}
    return {"tp": 1, "cp": tp, "pp": inner, "dp": inner * pp}


def rank_of(coords: Coords, tp: int, pp: int, cp: int = 1, dp: Optional[int] = None,
            order: str = DEFAULT_RANK_ORDER) -> int:
    c, s = coords, strides(tp, cp, pp, dp, order)
    return (c.tp_rank + s["cp"] * c.cp_rank + s["pp"] * c.pp_rank + s["dp"] * c.dp_rank)


def coords_of(rank: int, tp: int, pp: int, cp: int = 1, dp: Optional[int] = None,
              order: str = DEFAULT_RANK_ORDER) -> Coords:
    """The inverse of `rank_of` (`dp` matters only to tp-cp-dp-pp, where PP is outermost)."""
    s = strides(tp, cp, pp, dp, order)
    return Coords(tp_rank=rank % tp, cp_rank=(rank // tp) % cp,
                  pp_rank=(rank // s["pp"]) % pp, dp_rank=(rank // s["dp"]) % (dp or 1)
                  if order == "tp-cp-dp-pp" else rank // s["dp"])


def expert_coords(rank: int, tp: int, pp: int, cp: int, ep: int, dp: Optional[int] = None,
                  order: str = DEFAULT_RANK_ORDER) -> Tuple[int, int]:
    """(ep_rank, edp_rank) of `rank` in the folded expert grid (module docstring)."""
    c = coords_of(rank, tp, pp, cp, dp, order)
    i = c.tp_rank + tp * (c.cp_rank + cp * c.dp_rank)
    return i % ep, i // ep


def expert_rank_of(ep_rank: int, edp_rank: int, pp_rank: int, tp: int, pp: int, cp: int,
                   ep: int, dp: Optional[int] = None, order: str = DEFAULT_RANK_ORDER) -> int:
    """The global rank at (ep_rank, edp_rank) of pipeline stage `pp_rank`'s expert grid."""
    i = ep_rank + ep * edp_rank
    return rank_of(Coords(tp_rank=i % tp, cp_rank=(i // tp) % cp, pp_rank=pp_rank,
                          dp_rank=i // (tp * cp)), tp, pp, cp, dp, order)


def group_ranks(tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1,
                order: str = DEFAULT_RANK_ORDER) -> Dict[str, List[List[int]]]:
    """All rank lists of every group kind, derived from one grid of shape [dp, pp, cp, tp]
    whose ranks `rank_of` places in `order` (each list in the same coordinate order under
    either rank order; only the ranks differ).

    tp: ranks sharing (cp, pp, dp); cp: sharing (tp, pp, dp); pp: sharing (tp, cp, dp);
    dp: sharing (tp, cp, pp); mp (model parallel = TP x PP, one model replica's, for the
    global grad norm): sharing (cp, dp); embedding: first and last pipeline stage of each
    (tp, cp, dp) (just the stage when pp = 1); dp_cp (DP x CP, the ranks holding the same
    parameters: gradient reductions and ZeRO ranges): sharing (tp, pp) — listed only when
    cp > 1 (with cp = 1 it is the dp group, which the topology uses as is). With ep > 1 the
    folded expert grid's ep (sharing edp_rank, pp) and edp (sharing ep_rank, pp) groups.
    """
    def grid(t: int, c: int, p: int, d: int) -> int:
        return rank_of(Coords(tp_rank=t, pp_rank=p, dp_rank=d, cp_rank=c), tp, pp, cp, dp,
                       order)

    T, C, P, D = range(tp), range(cp), range(pp), range(dp)
    out: Dict[str, List[List[int]]] = {
        "tp": [[grid(t, c, p, d) for t in T] for d in D for p in P for c in C],
        "cp": [[grid(t, c, p, d) for c in C] for d in D for p in P for t in T],
        "pp": [[grid(t, c, p, d) for p in P] for d in D for c in C for t in T],
        "dp": [[grid(t, c, p, d) for d in D] for p in P for c in C for t in T],
        "mp": [[grid(t, c, p, d) for p in P for t in T] for d in D for c in C],
    }
    out["embedding"] = [sorted({r[0], r[-1]}) for r in out["pp"]]
    if cp > 1:
        out["dp_cp"] = [[grid(t, c, p, d) for d in D for c in C] for p in P for t in T]
    if ep > 1:
        edp = tp * cp * dp // ep

        def folded(e: int, x: int, p: int) -> int:
            return expert_rank_of(e, x, p, tp, pp, cp, ep, dp, order)

        out["ep"] = [[folded(e, x, p) for e in range(ep)] for p in P for x in range(edp)]
        out["edp"] = [[folded(e, x, p) for x in range(edp)] for p in P for e in range(ep)]
    return out


@dataclass
class Topology:
    """Sizes, this rank's coordinates and its process groups (`Group` handles)."""

    tp_size: int
    pp_size: int
    dp_size: int
    rank: int
    cp_size: int = 1
    ep_size: int = 1
    rank_order: str = DEFAULT_RANK_ORDER  # parallel.rank_order (module docstring)
    counter: CommCounter = field(default_factory=CommCounter)
    groups: Dict[str, Group] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.pp_size * self.dp_size

    @property
    def coords(self) -> Coords:
        return coords_of(self.rank, self.tp_size, self.pp_size, self.cp_size, self.dp_size,
                         self.rank_order)

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
        """The data-parallel replicas of this rank's (tp, cp, pp): the ranks that read
        different windows (the sampler's and the loader's split)."""
        return self.groups["dp"]

    @property
    def cp_group(self) -> Group:
        """The context-parallel ranks of this (tp, pp, dp): the same windows, each rank its
        chunks of every sequence (`megalite.parallel.context_shard`)."""
        return self.groups["cp"]

    @property
    def grad_group(self) -> Group:
        """DP x CP: the ranks holding the same parameters, over which gradients are averaged
        and ZeRO splits its ranges (the dp group itself when cp = 1)."""
        return self.groups["dp_cp"] if self.cp_size > 1 else self.groups["dp"]

    @property
    def ep_rank(self) -> int:
        """This rank's place in its stage's EP group (module docstring)."""
        return expert_coords(self.rank, self.tp_size, self.pp_size, self.cp_size,
                             self.ep_size, self.dp_size, self.rank_order)[0]

    @property
    def ep_group(self) -> Group:
        """The expert-parallel ranks of this stage that hold, together, one copy of every
        expert (E/ep each) and exchange tokens; one rank alone when ep = 1."""
        if self.ep_size > 1:
            return self.groups["ep"]
        return Group(name="ep", ranks=[self.rank], rank=0, pg=None, counter=self.counter)

    @property
    def expert_grad_group(self) -> Group:
        """EDP: the ranks holding the same experts, over which the experts' gradients are
        reduced and their ZeRO ranges split (DP x CP, `grad_group`, when ep = 1)."""
        return self.groups["edp"] if self.ep_size > 1 else self.grad_group

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
                f"cp={c.cp_rank}/{self.cp_size} pp={c.pp_rank}/{self.pp_size} "
                f"dp={c.dp_rank}/{self.dp_size}"
                + (f" ep={self.ep_rank}/{self.ep_size}" if self.ep_size > 1 else ""))


def build_topology(tp: int, pp: int, dp: int, rank: Optional[int] = None,
                   timeout_s: Optional[float] = None,
                   checkpoint_timeout_s: Optional[float] = None,
                   waits: Optional[CollectiveWaits] = None,
                   flight: Optional[object] = None, alone: bool = False,
                   cp: int = 1, ep: int = 1, order: str = DEFAULT_RANK_ORDER) -> Topology:
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
    process group is created or used. `order`: the dense rank order (`parallel.rank_order`).
    """
    world = tp * cp * pp * dp
    sizes = f"tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp}"
    if alone and world != 1:
        raise ValueError(f"alone: a world of one process, not {sizes}")
    initialized = not alone and dist.is_available() and dist.is_initialized()
    if initialized and dist.get_world_size() != world:
        raise ValueError(f"world size {dist.get_world_size()} != {sizes}")
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if not initialized and world != 1:
        raise RuntimeError("torch.distributed must be initialized for world size > 1")
    if (tp * cp * dp) % ep:
        raise ValueError(f"ep={ep} must divide tp*cp*dp = {tp * cp * dp}")
    topo = Topology(tp_size=tp, pp_size=pp, dp_size=dp, rank=rank, cp_size=cp, ep_size=ep,
                    rank_order=order, counter=CommCounter(waits=waits, flight=flight))
    named = _names_groups()
    for kind, rank_lists in group_ranks(tp, pp, dp, cp, ep, order).items():
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
