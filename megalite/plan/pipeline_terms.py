"""The time model's pipeline terms from the schedule's own order of operations
(`megalite.plan.pipeline_sim`): each stage's busy seconds a step (compute … offload, EP's
exchange and imbalance, the per-micro-batch terms of `megalite.plan.time_model`) cut into
operations — a micro-batch's forward, backward (under ZB-H1 / ZB-V its input gradient B and
its weight gradient W: the linears' weight-gradient matmuls, the head's, and the gradient
accumulation) in the ratio of the stage's forward and backward times, and over its chunks in
the ratio of their forward FLOPs — and the point-to-point transfers on the link each one
crosses (inside a node or over one NIC rail, `megalite.plan.links.send_link`). Two simulations
of the step, without and with the transfers, give per stage

  bubble  = makespan without transfers − the stage's busy seconds (its idle time)
  pp      = makespan with transfers − makespan without (what the transfers add)

and the data-parallel collectives' windows (`megalite.plan.pipeline_sim.DpWindows`): each
chunk's gradient reduction from its last backward on, each chunk's ZeRO gather before its
first forward ends — so what the pipeline's last and first micro-batches (and a stage's idle
time at the ends of the step) hide is not charged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from megalite.config.layout import Layout
from megalite.config.schedule_rules import resolve_schedule
from megalite.config.schema import Config
from megalite.model.families import family
from megalite.parallel.schedule import SPLIT_BACKWARD
from megalite.plan.comm_time import StagePass
from megalite.plan.devices import DeviceProfile
from megalite.plan.links import collective_time, send_link
from megalite.plan.pipeline_sim import DpWindows, OpTimes, dp_windows, simulate

BUSY = ("compute", "recompute", "non_matmul", "head_loss", "grad_accumulate", "tp", "cp",
        "offload", "ep", "expert_imbalance")


@dataclass
class PipelineTerms:
    bubble: List[float]  # per stage, seconds a step
    pp: List[float]
    windows: List[DpWindows]


def chunk_shares(cfg: Config, layout: Layout) -> List[List[float]]:
    """Per stage, each chunk's share of its forward FLOPs (its blocks' and the head's)."""
    m, s = cfg.model, cfg.train.seq_len
    fam = family(m)
    block = 2 * fam.block_parameters(m) + 4 * m.n_embd * s
    out = []
    for k, chunks in enumerate(layout.stage_blocks()):
        flops = [len(b) * block + (fam.head_forward_flops_per_token(m)
                                   if layout.placement.holds_last(k, c) else 0)
                 for c, b in enumerate(chunks)]
        total = sum(flops) or 1.0
        out.append([f / total for f in flops])
    return out


def hop_seconds(cfg: Config, layout: Layout, profile: DeviceProfile, gpus_per_node: int
                ) -> List[List[float]]:
    """[src][dst] seconds of one point-to-point transfer (an activation or its gradient,
    e·s'·b·h, 1/t of it with TP and no SP) between pipeline stages: over NVLink where every
    pair of their ranks shares a node, else over one NIC rail."""
    t, lay = cfg.train, layout
    e = 4 if lay.precision == "fp32" else 2
    scatter = lay.tp_size if lay.tp_size > 1 and not lay.sequence_parallel else 1
    nbytes = e * lay.activation_seq_len(t.seq_len) * t.micro_batch_size * cfg.model.n_embd \
        / scatter
    inner, pp = lay.tp_size * lay.cp_size, lay.pp_size  # ranks apart of neighbouring stages
    pattern = [(d, j) for d in range(min(lay.dp_size, gpus_per_node))  # repeats beyond a node
               for j in range(min(inner, gpus_per_node))]

    def crosses(a: int, b: int) -> bool:  # some rank of a and its peer of b on two nodes
        return any((inner * (a + pp * d) + j) // gpus_per_node
                   != (inner * (b + pp * d) + j) // gpus_per_node for d, j in pattern)
    times = {c: collective_time(nbytes, 1, send_link(profile, c), 2, "send_recv")
             for c in (False, True)}
    out = [[times[True]] * pp for _ in range(pp)]
    for a in range(pp):  # the pairs that exchange: neighbours, and the ends (interleaved)
        for b in {a - 1, a + 1, (a + 1) % pp, (a - 1) % pp} & set(range(pp)):
            out[a][b] = 0.0 if a == b else times[crosses(a, b)]
    return out


def op_times(stage_terms: Sequence[Dict[str, float]], passes: Sequence[StagePass],
             shares: Sequence[Sequence[float]], m: int, split: bool) -> OpTimes:
    """Each stage's busy seconds a step cut into its operations (module docstring)."""
    forward, backward, weight = [], [], []
    for terms, p, share in zip(stage_terms, passes, shares):
        per_micro = sum(terms[k] for k in BUSY) / m
        whole = (p.t_f + p.t_b) or 1.0
        f = per_micro * p.t_f / whole
        w = per_micro * p.t_w / whole if split else 0.0
        forward.append([f * a for a in share])
        backward.append([(per_micro - f - w) * a for a in share])
        weight.append([w * a for a in share])
    return OpTimes(forward, backward, weight)


def pipeline_terms(cfg: Config, layout: Layout, profile: DeviceProfile, gpus_per_node: int,
                   stage_terms: Sequence[Dict[str, float]], passes: Sequence[StagePass]
                   ) -> PipelineTerms:
    """bubble, pp and the DP windows of every stage (module docstring)."""
    pp, v = layout.pp_size, layout.virtual_stages
    m = layout.micro_batches(cfg.train.global_batch_size)
    if pp == 1:
        return PipelineTerms([0.0], [0.0], [DpWindows.single(passes[0].t_f, passes[0].t_b)])
    schedule = resolve_schedule(cfg.parallel.schedule, v)
    shares = chunk_shares(cfg, layout)
    times = op_times(stage_terms, passes, shares, m, schedule in SPLIT_BACKWARD)
    idle = simulate(pp, m, v, schedule, times)
    sent = simulate(pp, m, v, schedule, times, hop_seconds(cfg, layout, profile,
                                                           gpus_per_node))
    return PipelineTerms([max(0.0, idle.makespan - b) for b in idle.busy],
                         [sent.makespan - idle.makespan] * pp,
                         [dp_windows(sent, k, shares[k]) for k in range(pp)])
