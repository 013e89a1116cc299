"""Which links each process group of a layout uses, from the [TP, PP, DP] placement of ranks on
nodes (`rank = tp_rank + tp·(pp_rank + pp·dp_rank)`, nodes of `gpus_per_node` consecutive
ranks; ARCHITECTURE.md §3).

A group whose ranks share a node runs at the intra-node bus bandwidth. A group that spans
nodes with k of its ranks on each node uses k NIC rails at once (one NIC per GPU), so its bus
bandwidth is k × the one-rank-per-node inter-node figure, at most the intra-node one, and each
collective pays the inter-node latency. A pipeline transfer is one send over one rail: inter-node
when any neighbouring pair of stages sits on different nodes. The worst group of each kind
decides (collectives of a kind run in step on every group).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List

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


@lru_cache(maxsize=4096)
def _spread(world: int, groups: tuple, gpus_per_node: int) -> tuple:
    """(any group crosses nodes, the fewest ranks per node of a crossing group)."""
    crosses, fewest = False, gpus_per_node
    for ranks in groups:
        nodes: Dict[int, int] = {}
        for r in ranks:
            nodes[r // gpus_per_node] = nodes.get(r // gpus_per_node, 0) + 1
        if len(nodes) > 1:
            crosses, fewest = True, min(fewest, min(nodes.values()))
    return crosses, fewest


def _groups(layout: Layout) -> Dict[str, List[tuple]]:
    tp, pp, dp = layout.tp_size, layout.pp_size, layout.dp_size
    tp_groups = [tuple(range(b * tp, b * tp + tp)) for b in range(pp * dp)]
    dp_groups = [tuple(b + i * tp * pp for i in range(dp)) for b in range(tp * pp)]
    pp_pairs = [(t + tp * (s + pp * d), t + tp * (s + 1 + pp * d))
                for t in range(tp) for d in range(dp) for s in range(pp - 1)]
    emb = [(t + tp * pp * d, t + tp * (pp - 1 + pp * d)) for t in range(tp) for d in range(dp)]
    return {"tp": tp_groups, "dp": dp_groups, "pp": pp_pairs, "embedding": emb}


@lru_cache(maxsize=4096)
def _placement(tp: int, pp: int, dp: int, gpus_per_node: int) -> Dict[str, tuple]:
    layout = Layout(tp_size=tp, pp_size=pp, dp_size=dp)
    world = tp * pp * dp
    return {kind: _spread(world, tuple(groups), gpus_per_node)
            for kind, groups in _groups(layout).items()}


def group_links(layout: Layout, profile: DeviceProfile, gpus_per_node: int
                ) -> Dict[str, GroupLink]:
    """The effective link of the tp, pp, dp and embedding groups."""
    spread = _placement(layout.tp_size, layout.pp_size, layout.dp_size, gpus_per_node)
    intra, inter = profile.intra_node, profile.inter_node
    intra_ops = profile.op_links.get("intra_node", {})
    inter_ops = profile.op_links.get("inter_node", {})
    out = {}
    for kind, (crosses, per_node) in spread.items():
        if not crosses:
            out[kind] = GroupLink(intra, False, dict(intra_ops))
            continue
        rails = 1 if kind in ("pp", "embedding") else per_node

        def across(a: Link, b: Link) -> Link:
            return Link(min(a.bus_gbps, rails * b.bus_gbps), b.latency_s)
        out[kind] = GroupLink(across(intra, inter), True, {
            op: across(intra_ops.get(op, intra), link) for op, link in inter_ops.items()})
    return out
