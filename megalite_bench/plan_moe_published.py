"""The planner on the published MoE runs of Megatron-Core (issue 52's MoE rows): for each row
the time model's prediction of the published layout (model TFLOP/s per GPU: 6N + 12·L·h·s
with N the active parameters, Megatron's count) in Megatron's rank order, which the runs used
and megalite offers (`parallel.rank_order=tp-cp-dp-pp`: a stage's ranks consecutive, an EP
group on ceil(ep / GPUs per node) nodes), next to the publication, the load-imbalance factor
assumed (planner.moe_imbalance), the terms of the critical stage, the prediction in megalite's
default order (tp-cp-pp-dp: a stage's ranks tp·cp·pp apart, so EP spreads over more nodes),
and what megalite lacks that the run used, each with the prediction if megalite had it:

  node dedup      DeepEP's dispatcher sends a token once to each other node that holds one of
                  its experts and fans it out over NVLink there; megalite sends each (token,
                  expert) row. Under uniform routing a token's k choices among E experts on n
                  nodes reach (n − 1)·(1 − C(E − E/n, k)/C(E, k)) other nodes against
                  k·(n − 1)/n rows (`dedup_ratio`): the off-node bytes scaled by that ratio
  a2a overlap     Megatron's 1F1B all-to-all overlap (--overlap-moe-expert-parallel-comm)
                  hides a micro-batch's exchange behind another's compute: the exchange
                  hidden up to the stage's compute

Each "with" prediction adds its feature to the ones before it. The table's last column names,
for each row, the features its published run used that megalite lacks (`MoeRow.used`), each
with the prediction if megalite had it and the error against the publication (the overlap
against the overlapped figure where one is published). megalite's runtime runs these
layouts (EP folded over a stage's TP and DP ranks, expert TP = 1) in either order; the EP
group's nodes are those of its own ranks (`megalite.plan.expert_time.folded_groups`, the runtime's grid). No
device is used: arithmetic on the device table.

Published figures: Megatron-Core's MoE reports (Mixtral 8x22B: the MoE README's 128-H100
row, TP2 PP8 EP8, BF16, dropless, ~455 TFLOP/s; Qwen3-235B-A22B: the Megatron MoE model
zoo's best-practice table, 256 H100, sequence 4096, global batch 2048, micro-batch 1,
TP2 PP8 VPP4 EP32, DeepEP, 245 TFLOP/s, 276 with the 1F1B all-to-all overlap).
Assumed where the publication does not say: Mixtral's sequence 4096 and global batch 256
(the MoE examples' defaults), no recompute; ZeRO-1 (Megatron's distributed optimizer)."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megalite.config.layout import Layout, validate
from megalite.config.schedule_rules import expected_bubble
from megalite.config.schema import load_config
from megalite.plan.devices import DeviceProfile, device_profile, load_profile_file
from megalite.plan.expert_time import alltoall_s, expert_links, moe_blocks
from megalite.plan.time_model import Prediction, predict
from megalite.plan.traffic import stage_traffic


@dataclass(frozen=True)
class MoeRow:
    name: str
    preset: str  # conf/model/<preset>.yaml
    gpus: int
    tp: int
    pp: int
    v: int  # virtual stages
    ep: int
    seq: int
    batch: int  # global batch, sequences
    published: float  # model TFLOP/s per GPU
    overlapped: Optional[float]  # with the all-to-all overlapped, where published
    dispatcher: str  # what the publication ran
    used: Tuple[str, ...]  # the "with" features its run used that megalite lacks


ROWS = [
    MoeRow("Mixtral 8x22B", "mixtral-8x22b", 128, 2, 8, 1, 8, 4096, 256, 455.0, None,
           "alltoall", ()),
    MoeRow("Qwen3-235B-A22B", "qwen3-235b-a22b", 256, 2, 8, 4, 32, 4096, 2048, 245.0, 276.0,
           "DeepEP", ("+ node dedup",)),
]
MEGATRON_ORDER, DEFAULT_ORDER = "tp-cp-dp-pp", "tp-cp-pp-dp"  # parallel.rank_order


def row_config(row: MoeRow, imbalance: float, order: str = MEGATRON_ORDER
               ) -> Tuple[object, Layout]:
    """The row's configuration in rank order `order` and its layout (validated as a launch
    would be)."""
    cfg = load_config([f"parallel.rank_order={order}", f"model={row.preset}", f"tp={row.tp}",
                       f"pp={row.pp}", f"ep={row.ep}",
                       f"parallel.virtual_stages={row.v}", f"train.seq_len={row.seq}",
                       f"train.global_batch_size={row.batch}", "train.micro_batch_size=1",
                       "precision=bf16", "sp=true", "zero=1",
                       f"planner.moe_imbalance={imbalance}"])
    validate(cfg, row.gpus)
    return cfg, Layout.from_config(cfg, row.gpus, "cuda")


def dedup_ratio(experts: int, k: int, nodes: int) -> float:
    """Off-node bytes of a node-deduplicating dispatch over a per-row one (module
    docstring), uniform routing."""
    if nodes <= 1:
        return 1.0
    per_node = experts // nodes
    miss = math.comb(experts - per_node, k) / math.comb(experts, k)
    return (nodes - 1) * (1 - miss) / (k * (nodes - 1) / nodes)


def _step_without(pred: Prediction, beta: float, busy_saved: float) -> float:
    """The step with `busy_saved` seconds less busy time on the critical stage (the bubble
    scales with busy time: busy·β/(1 − β))."""
    return pred.step_s - busy_saved / (1 - beta)


def predict_row(row: MoeRow, profile: DeviceProfile, per_node: int, imbalance: float = 1.0
                ) -> Dict[str, object]:
    """The prediction of `row` and the 'with' predictions of the module docstring (model
    TFLOP/s per GPU each), with the critical stage's terms."""
    cfg, lay = row_config(row, imbalance)
    stages = stage_traffic(cfg, lay)
    pred = predict(cfg, lay, stages, profile, per_node)
    dcfg, dlay = row_config(row, imbalance, DEFAULT_ORDER)
    default = predict(dcfg, dlay, stage_traffic(dcfg, dlay), profile, per_node)
    k, terms = pred.critical_stage, pred.terms
    m = lay.micro_batches(cfg.train.global_batch_size)
    beta = expected_bubble(lay.pp_size, m, lay.virtual_stages, cfg.parallel.schedule)
    chunks = lay.stage_blocks()[k]
    calls = m * moe_blocks(cfg, chunks) * 5
    wire = imbalance * stages[k].comm["ep"]
    nodes = expert_links(lay, profile, per_node).ep_nodes
    ours_s = alltoall_s(wire, calls, row.ep, nodes, profile)
    moe = cfg.model.moe
    ratio = dedup_ratio(moe.num_experts, moe.top_k, nodes)
    dedup_s = alltoall_s(wire * ratio, calls, row.ep, nodes, profile) if nodes > 1 \
        else ours_s
    hidden_s = min(dedup_s, terms["compute"])
    steps = {"megalite": pred.step_s, DEFAULT_ORDER: default.step_s,
             "+ node dedup": _step_without(pred, beta, ours_s - dedup_s),
             "+ a2a overlap": _step_without(pred, beta, ours_s - dedup_s + hidden_s)}
    scale = pred.model_tflops_per_device * pred.step_s
    return {"row": row, "imbalance": imbalance, "prediction": pred,
            "tflops": {name: scale / s for name, s in steps.items()},
            "ep_nodes": (nodes, expert_links(dlay, profile, per_node).ep_nodes),
            "dedup_ratio": ratio}


LACKED = {"+ node dedup": "DeepEP's node dedup"}


def lacks(out: Dict[str, object]) -> str:
    """The features the row's run used that megalite lacks, each with the prediction if
    megalite had it (and those before it) and its error; the a2a overlap against the
    overlapped figure where one is published."""
    row, tf = out["row"], out["tflops"]
    parts = [f"{LACKED[name]} {tf[name]:.0f} ({tf[name] / row.published - 1:+.0%})"
             for name in row.used]
    if row.overlapped:
        name = "+ a2a overlap"
        parts.append(f"a2a overlap {tf[name]:.0f} ({tf[name] / row.overlapped - 1:+.0%} "
                     f"of {row.overlapped:.0f})")
    return "; ".join(parts) or "none of these"


def table(profile: DeviceProfile, per_node: int, imbalance: float = 1.0) -> List[str]:
    """The markdown table of every row (docs/planner.md's)."""
    lines = ["| run | GPUs | layout | f | predicted TFLOP/s | published | error | critical "
             f"stage's terms (s a step) | EP nodes ({MEGATRON_ORDER} / {DEFAULT_ORDER}) | "
             f"in {DEFAULT_ORDER} | + node dedup | + a2a overlap | megalite lacks (with it) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        out = predict_row(row, profile, per_node, imbalance)
        tf, pred = out["tflops"], out["prediction"]
        terms = ", ".join(f"{k} {v:.2f}" for k, v in pred.terms.items() if v >= 0.005)
        published = f"{row.published:.0f}" + (f" ({row.overlapped:.0f} overlapped)"
                                               if row.overlapped else "")
        layout = f"TP{row.tp} PP{row.pp}" + (f" VPP{row.v}" if row.v > 1 else "") \
            + f" EP{row.ep}, s {row.seq}, batch {row.batch}, {row.dispatcher}"
        lines.append(
            f"| {row.name} | {row.gpus} | {layout} | {imbalance:g} | {tf['megalite']:.0f} | "
            f"{published} | {tf['megalite'] / row.published - 1:+.0%} | {terms} | "
            f"{out['ep_nodes'][0]} / {out['ep_nodes'][1]} | {tf[DEFAULT_ORDER]:.0f} | "
            f"{tf['+ node dedup']:.0f} (x{out['dedup_ratio']:.2f} off-node bytes) | "
            f"{tf['+ a2a overlap']:.0f} | {lacks(out)} |")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="h100-80gb", help="device profile name")
    p.add_argument("--profile", default=None, help="a calibrated profile file instead")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--imbalance", type=float, default=1.0,
                   help="planner.moe_imbalance: the busiest EP rank's rows over the mean")


def run(args) -> None:
    profile = load_profile_file(args.profile) if args.profile else device_profile(args.device)
    print(f"device: {profile.name} ({profile.source}), {args.gpus_per_node} per node")
    print("\n".join(table(profile, args.gpus_per_node, args.imbalance)))
