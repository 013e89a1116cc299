"""The exposed seconds of each group's communication in a stage's step (the time model's tp,
cp, dp and embedding terms; `megalite.plan.time_model`'s docstring has the rules, CP's
are `megalite.plan.cp_terms`', the pipeline's transfers `megalite.plan.pipeline_terms`')."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.plan import cp_terms
from megalite.plan.dims import tp_collectives
from megalite.plan.expert_time import expert_elements
from megalite.plan.fp8_terms import amax_reductions
from megalite.plan.links import GroupLink, collective_time
from megalite.plan.pipeline_sim import DpWindows, exposed_s


@dataclass(frozen=True)
class StagePass:
    """What a stage's communication is timed against: micro-batches m, bytes e, blocks and
    recomputed blocks, whether it holds the model's ends, one micro-batch's forward and
    backward seconds and the matmul rate; `t_w`: of the backward, the weight gradients'
    seconds (a zero-bubble schedule's W)."""

    m: int
    e: int
    blocks: int
    rerun: int
    first: bool
    last: bool
    t_f: float
    t_b: float
    rate: float
    t_w: float = 0.0


def comm_terms(cfg: Config, lay: Layout, stage, links: Dict[str, GroupLink],
               chunks: List[range], p: StagePass) -> Dict[str, float]:
    """{tp, cp, embedding}: each group's exposed seconds a step (dp: `dp_term`)."""
    m, e = p.m, p.e
    terms = dict.fromkeys(("tp", "cp", "embedding"), 0.0)
    if lay.tp_size > 1:
        terms["tp"] = _tp_term(cfg, lay, stage, links["tp"], chunks, p.first, p.last, m,
                               p.blocks, p.rerun)
    terms["cp"] = m * cp_terms.exposed_s(cfg, lay, e, p.blocks, p.rerun, p.rate, links["cp"],
                                         links["cp_send"])
    if stage.comm["embedding"]:
        terms["embedding"] = collective_time(stage.comm["embedding"], 1, links["embedding"], 2)
    return terms


def dp_term(cfg: Config, lay: Layout, stage, links: Dict[str, GroupLink], p: StagePass,
            windows: DpWindows, chunks) -> float:
    """The stage's exposed DP seconds a step; `windows`: what its per-step reduction and
    gather run against (`megalite.plan.pipeline_terms`); `chunks` its blocks (EP's experts
    among them are reduced over EDP, `megalite.plan.expert_time`)."""
    units = p.blocks + 2 * p.first + 2 * p.last  # ZeRO-3's gathered units
    dense = stage.params - expert_elements(cfg, lay, chunks)
    return _dp_exposed(cfg, lay, stage.comm["dp"], dense, p.m, p.t_f, p.t_b,
                       links["dp"], units, windows, stage.gathers)


def _dp_exposed(cfg: Config, layout: Layout, dp_bytes: float, psi: int, m: int,
                t_f: float, t_b: float, link: GroupLink, units: int, windows: DpWindows,
                gathers: int) -> float:
    """Exposed DP time per step (`megalite.plan.time_model`'s docstring): over the DP x CP
    ranks that reduce the gradients; zero 3: `gathers` unit all-gathers a step (the
    schedule's walk, `megalite.plan.zero3_gathers`)."""
    n = layout.grad_replicas
    if n == 1 or dp_bytes == 0:
        return 0.0
    ring = (n - 1) / n
    buckets = units if layout.zero_stage == 3 else \
        max(1.0, 4 * psi / (cfg.parallel.bucket_mb * 2**20))  # collectives per pass
    zero = layout.zero_stage
    if zero == 0:
        return exposed_s(collective_time(dp_bytes, buckets, link, n, "all_reduce"),
                         windows.reduce)
    per_micro = zero >= 2
    reduce_bytes = ring * 4 * psi * (m if per_micro else 1)
    gather_bytes = dp_bytes - reduce_bytes
    reduce = collective_time(reduce_bytes, buckets * (m if per_micro else 1), link, n,
                        "reduce_scatter")
    gather = collective_time(gather_bytes, gathers if zero == 3 else buckets, link, n,
                        "all_gather")
    if zero in (1, 2):
        exposed = exposed_s(reduce, windows.reduce) if zero == 1 \
            else m * max(0.0, reduce / m - t_b)
        return exposed + (exposed_s(gather, windows.gather)
                          if cfg.parallel.overlap_param_gather else gather)
    if not cfg.parallel.reshard_after_forward:  # one gather per step, before the first forward
        return max(0.0, gather - t_f) + m * max(0.0, reduce / m - t_b)
    g = gather / (2 * m)  # per micro-batch: the forward's gathers, then the backward's
    return m * (max(0.0, g - t_f) + max(0.0, g + reduce / m - t_b))


def _tp_term(cfg: Config, lay: Layout, stage, link: GroupLink, chunks: List[range],
             first: bool, last: bool, m: int, blocks: int, rerun: int) -> float:
    """TP's all-reduces (SP: all-gathers, reduce-scatters 6 : 4) and FP8's amax reductions."""
    tp = lay.tp_size
    (amax, elements), (amax_re, elements_re) = amax_reductions(cfg, tp), \
        amax_reductions(cfg, tp, True)
    amax_wire = m * 2 * (tp - 1) / tp * 4 * (blocks * elements + rerun * elements_re)
    wire, count = stage.comm["tp"] - amax_wire, \
        m * tp_collectives(cfg, lay, chunks, first, last)
    term = collective_time(wire, count, link, tp) if not lay.sequence_parallel \
        else 0.6 * collective_time(wire, count, link, tp, "all_gather") \
        + 0.4 * collective_time(wire, count, link, tp, "reduce_scatter")
    return term + collective_time(amax_wire, m * (blocks * amax + rerun * amax_re), link, tp)
