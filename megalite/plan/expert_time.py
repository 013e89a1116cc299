"""Expert parallelism in the time model (`megalite.plan.time_model`'s ep, edp and
expert_imbalance terms): the token exchange on the link the EP group spans, the experts'
gradient reductions over EDP, and the load imbalance of the routed experts.

Where the groups sit: the folded grid of `megalite.parallel.topology` (within each pipeline
stage the tp·cp·dp ranks i = tp_rank + tp·(cp_rank + cp·dp_rank) regrouped into
i = ep_rank + ep·edp_rank), placed on nodes of `gpus_per_node` consecutive ranks. An EP group
inside one node exchanges at the intra-node bus bandwidth; one that spans nodes sends each
rank's rows for the other nodes over its own NIC rail (an all-to-all has no ring of rails), so
a rank's exchange takes max(the off-node share of its bytes at the inter-node rate, the rest
at the intra-node rate) + one latency a collective (the messages to the ep − 1 peers leave at
once, not in a ring's ep − 1 steps). Under the default rank order tp-cp-pp-dp the folded group
fits a node while ep <= tp·cp, or while the ep / (tp·cp) DP indices it takes, tp·cp·pp ranks
apart, fit one node (pp sits inside DP). Under tp-cp-dp-pp (`parallel.rank_order`,
Megatron-Core's default) a stage's ranks are consecutive, so an EP group is ep consecutive
ranks and EP <= 8 stays inside a node at any pp (`megalite-bench plan-moe` prices both).

  ep          the plan's EP wire bytes (`stage.comm["ep"]`: the counts and the rows out and
              back, forward and backward, under balanced routing) on the EP link: blocking,
              in each MoE layer's critical path (megalite does not overlap the exchange with
              compute; Megatron-Core's `--overlap-moe-expert-parallel-comm` hides it behind
              another micro-batch's compute, which megalite lacks). The rows' share is × f:
              the busiest EP rank receives f × the mean rows (its sends are balanced; the
              exchange takes the larger side)
  expert_imbalance   (f − 1) × the routed experts' matmul time: the busiest EP rank computes
              f × the mean rows (f = planner.moe_imbalance: max over EP ranks / mean of the
              rows an EP rank computes; `megalite-plan --moe-imbalance-from RUN` reads it
              from a run's logged per-layer figures, `megalite.cli.plan_moe`), the others
              wait for it at the combine's exchange; the routed experts' FLOPs are 6·k·h·I a
              token and MoE layer forward (k experts' gate/up and down products, 2 FLOPs a
              weight), × 3 with the backward, + a recomputed layer's re-run
  edp         the experts' gradient reductions over EDP (`stage.comm["edp"]`), timed as DP's
              zero 0/1 (the all-reduce or reduce-scatter exposed beyond the last backward,
              ZeRO-1's all-gather after the step); the dense reductions' and the experts'
              sharing of that backward window is not modelled

Without expert parallelism (ep = 1) every rank computes all its tokens' experts: no exchange,
and a skewed routing changes no rank's total rows, so f is not applied.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Tuple

from megalite.config.layout import Layout
from megalite.config.schema import DEFAULT_RANK_ORDER, Config
from megalite.parallel.topology import expert_rank_of
from megalite.plan.devices import DeviceProfile, Link
from megalite.plan.links import GroupLink, collective_time

EXPERT_TERMS = ("ep", "edp", "expert_imbalance")


def folded_groups(tp: int, cp: int, pp: int, dp: int, ep: int,
                  order: str = DEFAULT_RANK_ORDER) -> Dict[str, List[tuple]]:
    """The ep and edp groups' global ranks in rank order `order`: the runtime's own folded
    grid (`megalite.parallel.topology.expert_rank_of`, the ranks its groups are made of)."""
    def rank(e: int, x: int, s: int) -> int:
        return expert_rank_of(e, x, s, tp, pp, cp, ep, dp, order)
    edp = tp * cp * dp // ep
    return {"ep": [tuple(rank(e, x, s) for e in range(ep)) for s in range(pp)
                   for x in range(edp)],
            "edp": [tuple(rank(e, x, s) for x in range(edp)) for s in range(pp)
                    for e in range(ep)]}


@lru_cache(maxsize=1024)
def _spans(tp: int, cp: int, pp: int, dp: int, ep: int, per_node: int, order: str
           ) -> Dict[str, Tuple[int, int]]:
    """Per group kind, over its groups: (the fewest ranks a node holds of a group that
    spans nodes, 0 where none does; the most nodes a group spans)."""
    out = {}
    for kind, groups in folded_groups(tp, cp, pp, dp, ep, order).items():
        fewest, nodes_max = 0, 1
        for ranks in groups:
            nodes: Dict[int, int] = {}
            for r in ranks:
                nodes[r // per_node] = nodes.get(r // per_node, 0) + 1
            if len(nodes) > 1:
                low = min(nodes.values())
                fewest = low if not fewest else min(fewest, low)
            nodes_max = max(nodes_max, len(nodes))
        out[kind] = (fewest, nodes_max)
    return out


@dataclass(frozen=True)
class ExpertLinks:
    ep_crosses: bool
    ep_nodes: int  # the most nodes an EP group spans
    edp: GroupLink


def expert_links(layout: Layout, profile: DeviceProfile, gpus_per_node: int) -> ExpertLinks:
    """Where the EP and EDP groups of `layout` sit (module docstring)."""
    spans = _spans(layout.tp_size, layout.cp_size, layout.pp_size, layout.dp_size,
                   layout.ep_size, gpus_per_node, layout.rank_order)
    intra, inter = profile.intra_node, profile.inter_node
    fewest = spans["edp"][0]
    edp = GroupLink(intra, False) if not fewest else GroupLink(
        Link(min(intra.bus_gbps, fewest * inter.bus_gbps), inter.latency_s), True)
    return ExpertLinks(spans["ep"][0] > 0, spans["ep"][1], edp)


def alltoall_s(wire: float, collectives: float, ep: int, nodes: int, profile: DeviceProfile
               ) -> float:
    """Seconds of `collectives` all-to-alls over `ep` ranks on `nodes` nodes moving `wire`
    bytes out of a rank (module docstring): the off-node share (ranks on other nodes over
    the ep − 1 peers, evenly spread) on the rank's NIC rail, the rest inside its node."""
    intra, inter = profile.intra_node, profile.inter_node
    if nodes == 1:
        return wire / (intra.bus_gbps * 1e9) + collectives * intra.latency_s
    off = (ep - ep // nodes) / (ep - 1)
    return max(off * wire / (inter.bus_gbps * 1e9), (1 - off) * wire / (intra.bus_gbps * 1e9)) \
        + collectives * inter.latency_s


def moe_blocks(cfg: Config, chunks: List[range]) -> int:
    """The stage's blocks with an MoE layer."""
    moe = cfg.model.moe
    return sum(moe.is_moe_layer(i) for b in chunks for i in b) if moe.enabled else 0


def expert_elements(cfg: Config, layout: Layout, chunks: List[range]) -> int:
    """The routed experts' parameter elements a rank of the stage reduces over EDP rather
    than DP x CP: with ep > 1, E/ep experts of 3·h·I each ([gate | up] and down) per MoE
    block (expert TP = 1); 0 at ep = 1 (the experts are reduced with the rest)."""
    m = cfg.model
    if not m.moe.enabled or layout.ep_size == 1:
        return 0
    per_expert = 3 * m.n_embd * m.moe.expert_hidden(m.ffn_size)
    return moe_blocks(cfg, chunks) * m.moe.num_experts // layout.ep_size * per_expert


def routed_expert_flops(cfg: Config) -> int:
    """One token's routed experts' forward FLOPs in one MoE layer: 2 × k × 3·h·I."""
    m = cfg.model
    return 6 * m.moe.top_k * m.n_embd * m.moe.expert_hidden(m.ffn_size)


def expert_terms(cfg: Config, lay: Layout, stage, links: ExpertLinks, profile: DeviceProfile,
                 chunks: List[range], m: int, rerun: int, t_b: float) -> Dict[str, float]:
    """{ep, edp, expert_imbalance}: seconds a step of the stage's rank (module docstring);
    `rerun`: recomputed blocks, `t_b`: one micro-batch's backward."""
    terms = dict.fromkeys(EXPERT_TERMS, 0.0)
    blocks = moe_blocks(cfg, chunks)
    if lay.ep_size == 1 or not blocks:
        return terms
    f, ep = cfg.planner.moe_imbalance, lay.ep_size
    moe_rerun = min(rerun, blocks)  # a recomputed MoE layer's forward exchange again
    exchanges = m * (blocks + moe_rerun)
    counts = 8 * cfg.model.moe.num_experts * (ep - 1) / ep * exchanges  # alltoall's counts
    alltoall = cfg.parallel.ep_dispatch == "alltoall"
    rows = stage.comm["ep"] - (counts if alltoall else 0.0)
    calls = m * blocks * (5 if alltoall else 7) + m * moe_rerun * (3 if alltoall else 4)
    terms["ep"] = alltoall_s((counts if alltoall else 0.0) + f * rows, calls, ep,
                             links.ep_nodes, profile)
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len // lay.cp_size / lay.tp_size
    terms["expert_imbalance"] = (f - 1) * m * (3 * blocks + moe_rerun) * tokens \
        * routed_expert_flops(cfg) / profile.rate(lay.precision)
    edp = lay.expert_grad_replicas
    if edp > 1 and stage.comm.get("edp"):
        psi = expert_elements(cfg, lay, chunks)
        ring = (edp - 1) / edp
        reduce = (2 if lay.zero_stage == 0 else 1) * ring * 4 * psi
        buckets = max(1.0, 4 * psi / (cfg.parallel.bucket_mb * 2**20))
        op = "all_reduce" if lay.zero_stage == 0 else "reduce_scatter"
        terms["edp"] = max(0.0, collective_time(reduce, buckets, links.edp, edp, op) - t_b) \
            + collective_time(max(0.0, stage.comm["edp"] - reduce), 1, links.edp, edp,
                              "all_gather")
    return terms
