"""Which links each process group of a layout uses, from the placement of ranks on nodes in the
layout's rank order (`parallel.rank_order`: `rank = tp_rank + tp·(cp_rank + cp·(pp_rank +
pp·dp_rank))` by default, PP outermost under tp-cp-dp-pp; `megalite.parallel.topology`), nodes of
`gpus_per_node` consecutive ranks (ARCHITECTURE.md §3), and what a collective costs on one
(`collective_time`: its bytes at the bus bandwidth, its latency as NCCL's own model prices a
ring, `collective_latency`). Not modelled: NCCL's tree all-reduce across nodes (log-depth
latency, chosen by NCCL where it is faster), a ring's intra-node steps in a group that spans
nodes (all its steps are priced at the inter-node latency).

A group whose ranks share a node runs at the intra-node bus bandwidth. A group that spans
nodes with k of its ranks on each node uses k NIC rails at once (one NIC per GPU), so its bus
bandwidth is k × the one-rank-per-node inter-node figure, at most the intra-node one, and each
collective pays the inter-node latency. A pipeline transfer is one send over one rail: inter-node
when any neighbouring pair of stages sits on different nodes; so is a CP ring's send
(`cp_send`) when its CP group spans nodes. The gradient reductions span DP x CP (`dp`: the
ranks holding the same parameters). The worst group of each kind decides (collectives of a
kind run in step on every group).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, Tuple

from megalite.config.layout import Layout
from megalite.parallel.topology import strides
from megalite.plan.devices import DeviceProfile, Link


@dataclass(frozen=True)
class GroupLink:
    link: Link  # effective bus bandwidth and latency per collective
    crosses_nodes: bool
    ops: Dict[str, Link] = field(default_factory=dict, hash=False)  # per collective kind,
    #                                                                 where calibrated

    def of(self, op: str) -> Link:
        """The link for collectives of kind `op` (its own fit where measured)."""
        return self.ops.get(op, self.link)


def _spread(offsets: tuple, bases, gpus_per_node: int) -> tuple:
    """(any group crosses nodes, the fewest ranks per node of a crossing group) of the groups
    {base + o for o in offsets}. Which nodes a group's ranks fall on depends on its base only
    through base mod gpus_per_node (a shift by a node's ranks shifts every node index by
    one), so one group of each residue is examined, not every rank."""
    crosses, fewest = False, gpus_per_node
    for base in {b % gpus_per_node for b in bases}:
        nodes: Dict[int, int] = {}
        for o in offsets:
            nodes[(base + o) // gpus_per_node] = nodes.get((base + o) // gpus_per_node, 0) + 1
        if len(nodes) > 1:
            crosses, fewest = True, min(fewest, min(nodes.values()))
    return crosses, fewest


def _groups(tp: int, cp: int, pp: int, dp: int, order: str) -> Dict[str, Tuple[tuple, list]]:
    """Per kind, (the offsets of a group's ranks from its first, the first ranks), from the
    runtime's own rank strides in `order` (`megalite.parallel.topology.strides`)."""
    st = strides(tp, cp, pp, dp, order)
    sc, sp, sd = st["cp"], st["pp"], st["dp"]
    T, C, P, D = range(tp), range(cp), range(pp), range(dp)
    bases = {
        "tp": [sc * c + sp * s + sd * d for c in C for s in P for d in D],
        "cp": [t + sp * s + sd * d for t in T for s in P for d in D],
        "dp": [t + sp * s for t in T for s in P],
        "pp": [t + sc * c + sp * s + sd * d for t in T for c in C for d in D
               for s in range(pp - 1)],
        "embedding": [t + sc * c + sd * d for t in T for c in C for d in D],
    }
    offsets = {"tp": tuple(T), "cp": tuple(sc * c for c in C),
               "dp": tuple(sd * d + sc * c for d in D for c in C),
               "pp": (0, sp), "embedding": (0, sp * (pp - 1))}
    out = {kind: (offsets[kind], bases[kind]) for kind in bases}
    out["cp_send"] = out["cp"]
    return out


@lru_cache(maxsize=4096)
def _placement(tp: int, cp: int, pp: int, dp: int, gpus_per_node: int, order: str
               ) -> Dict[str, tuple]:
    return {kind: _spread(offsets, bases, gpus_per_node)
            for kind, (offsets, bases) in _groups(tp, cp, pp, dp, order).items()}


def group_links(layout: Layout, profile: DeviceProfile, gpus_per_node: int
                ) -> Dict[str, GroupLink]:
    """The effective link of the tp, cp (collectives; cp_send: its ring's sends), pp, dp
    (DP x CP) and embedding groups."""
    spread = _placement(layout.tp_size, layout.cp_size, layout.pp_size, layout.dp_size,
                        gpus_per_node, layout.rank_order)
    out = {}
    for kind, (crosses, per_node) in spread.items():
        rails = 1 if kind in ("pp", "embedding", "cp_send") else per_node
        out[kind] = _across(profile, rails) if crosses else send_link(profile, False)
    return out


def _across(profile: DeviceProfile, rails: int) -> GroupLink:
    """A group spanning nodes over `rails` NIC rails a node (at most the intra-node link)."""
    intra, intra_ops = profile.intra_node, profile.op_links.get("intra_node", {})

    def across(a: Link, b: Link) -> Link:
        return Link(min(a.bus_gbps, rails * b.bus_gbps), b.latency_s)
    return GroupLink(across(intra, profile.inter_node), True, {
        op: across(intra_ops.get(op, intra), link)
        for op, link in profile.op_links.get("inter_node", {}).items()})


def send_link(profile: DeviceProfile, crosses_nodes: bool) -> GroupLink:
    """The link of a point-to-point transfer: NVLink inside a node, one NIC rail across."""
    if crosses_nodes:
        return _across(profile, 1)
    return GroupLink(profile.intra_node, False, dict(profile.op_links.get("intra_node", {})))


# NCCL's latency model of a ring collective (src/graph/tuning.cc, ncclTopoTuneModel, the
# same form from NCCL 2.8 of 2020 on): baseLat + nsteps × hwLat, nsteps = 2(n − 1) for an
# all-reduce, n − 1 for an all-gather or a reduce-scatter; baseLat of the Simple protocol
# (the large messages training sends) 8.4 µs, hwLat a ring step (NVLink 3.4 µs, network
# 9.6-14 µs). The device table's 2-rank latencies agree with it: NVLink 15 µs (NCCL:
# 8.4 + 2 × 3.4 = 15.2), across nodes 30 µs (8.4 + 2 × 9.6 = 27.6).
NCCL_RING_BASE_S = 8.4e-6
STEPS_AT_TWO = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "send_recv": 1}


def ring_steps(op: str, ranks: int) -> int:
    """The steps of a ring collective of kind `op` over `ranks` ranks (NCCL's nsteps)."""
    return 2 * (ranks - 1) if op == "all_reduce" else ranks - 1


def ring_step_s(fit: Link, op: str = "all_reduce") -> float:
    """One ring step's latency (NCCL's hwLat) of a link whose latency is `fit`'s: the 2-rank
    collective's small-message time of kind `op` (a link without its own fit for the kind:
    the 2-rank all-reduce's, as nccl-tests reports it) less NCCL's base, over its steps at 2
    ranks; the base is at most the whole latency."""
    return (fit.latency_s - min(NCCL_RING_BASE_S, fit.latency_s)) / STEPS_AT_TWO[op]


def collective_latency(link: GroupLink, ranks: int, op: str = "all_reduce") -> float:
    """One collective's latency over `ranks` ranks: NCCL's base + its ring steps × a step's
    latency (`ring_step_s`), from the kind's own fit where the profile has one (`op_links`),
    else from the link's (a 2-rank all-reduce's); 0 on one rank. A pipeline send is one
    step: the fit's whole latency."""
    if ranks < 2:
        return 0.0
    fit, own = link.of(op), op in link.ops
    if op == "send_recv":
        return fit.latency_s
    step = ring_step_s(fit, op if own else "all_reduce")
    base = fit.latency_s - STEPS_AT_TWO[op if own else "all_reduce"] * step
    return base + ring_steps(op, ranks) * step


def collective_time(wire_bytes: float, collectives: float, link: GroupLink, ranks: int,
                    op: str = "all_reduce") -> float:
    """Seconds of `collectives` collectives of kind `op` over `ranks` ranks moving
    `wire_bytes` in all: wire bytes at the bus bandwidth (the kind's own fit where the profile
    has one, else the link's) + each one's `collective_latency`."""
    return wire_bytes / (link.of(op).bus_gbps * 1e9) \
        + collectives * collective_latency(link, ranks, op)
