"""Which links each process group of a layout uses, from the [TP, CP, PP, DP] placement of ranks
on nodes (`rank = tp_rank + tp·(cp_rank + cp·(pp_rank + pp·dp_rank))`, nodes of `gpus_per_node`
consecutive ranks; ARCHITECTURE.md §3), and what a collective costs on one
(`collective_time`).

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


def _groups(tp: int, cp: int, pp: int, dp: int) -> Dict[str, Tuple[tuple, range]]:
    """Per kind, (the offsets of a group's ranks from its first, the first ranks): `rank =
    t + tp·(c + cp·(s + pp·d))`."""
    stage, replica = tp * cp, tp * cp * pp  # rank strides of s and d
    bases = {
        "tp": range(0, tp * cp * pp * dp, tp),
        "cp": [t + replica * d + stage * s for t in range(tp) for s in range(pp)
               for d in range(dp)],
        "dp": [t + stage * s for t in range(tp) for s in range(pp)],
        "pp": [t + tp * c + stage * s + replica * d for t in range(tp) for c in range(cp)
               for d in range(dp) for s in range(pp - 1)],
        "embedding": [t + tp * c + replica * d for t in range(tp) for c in range(cp)
                      for d in range(dp)],
    }
    offsets = {"tp": tuple(range(tp)), "cp": tuple(tp * c for c in range(cp)),
               "dp": tuple(replica * d + tp * c for d in range(dp) for c in range(cp)),
               "pp": (0, stage), "embedding": (0, stage * (pp - 1))}
    out = {kind: (offsets[kind], bases[kind]) for kind in bases}
    out["cp_send"] = out["cp"]
    return out


@lru_cache(maxsize=4096)
def _placement(tp: int, cp: int, pp: int, dp: int, gpus_per_node: int) -> Dict[str, tuple]:
    return {kind: _spread(offsets, bases, gpus_per_node)
            for kind, (offsets, bases) in _groups(tp, cp, pp, dp).items()}


def group_links(layout: Layout, profile: DeviceProfile, gpus_per_node: int
                ) -> Dict[str, GroupLink]:
    """The effective link of the tp, cp (collectives; cp_send: its ring's sends), pp, dp
    (DP x CP) and embedding groups."""
    spread = _placement(layout.tp_size, layout.cp_size, layout.pp_size, layout.dp_size,
                        gpus_per_node)
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


def collective_time(wire_bytes: float, collectives: float, link: GroupLink, ranks: int,
                    op: str = "all_reduce") -> float:
    """Seconds of `collectives` collectives of kind `op` over `ranks` ranks moving
    `wire_bytes` in all: wire bytes at the bus bandwidth + the latency of each: a ring takes
    ranks − 1 steps, each the profile's latency (that of a 2-rank collective, its smallest
    group) — the kind's own fit where the profile has one (`op_links`), else the link's."""
    fit = link.of(op)
    return wire_bytes / (fit.bus_gbps * 1e9) + collectives * (ranks - 1) * fit.latency_s
