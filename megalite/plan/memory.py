"""Before launch: what each rank will hold and send, from the configuration alone (Megatron's
theoretical memory report, with ZeRO's placement vocabulary).

For every pipeline stage, per rank (Ψ = parameter elements of the rank's TP slice of the stage,
vocabulary padded; N = DP size; t = TP size; m = micro-batches per step; e = bytes of the
compute dtype, 2 for bf16 and fp16, 4 for fp32):

  P, G, O    `model_state_bytes` (the ZeRO table, `zero_table()`): parameters e·Ψ, fp32
              gradients 4·Ψ, AdamW moments 8·Ψ + fp32 master 4·Ψ where e < 4; /N where sharded;
              zero 2/3 also stage (REDUCTIONS_IN_FLIGHT + 1) full fp32 buckets (the largest)
  A activations   per micro-batch × micro-batches in flight, min(pp − stage, m) under 1F1B;
              interleaved (v chunks): the peak over the stage's order of the alive chunks'
              bytes (`megalite.parallel.schedule.peak_live_bytes`)
              per layer (Korthikanti et al. 2022, with fused attention and no stored scores):
                e·sbh(4 + 12/t)   TP         e·sbh·16/t   TP + SP
                + 16·s'b (LayerNorm mean/rstd) + 4·(a/t)·sb (attention log-sum-exp)
                + 2·s'bh (residual dropout masks, resid_pdrop > 0)      s' = s/t with SP
              recompute: e·s'bh per recomputed layer (the block input) + one layer's full
              set (the layer being re-run); train.recompute_layers = r: r layers of each stage
              recomputed, the others keep their full set
              first stage: token ids 8·sb (+ embedding dropout mask); last stage: ln_f input and
              output e·s'bh each, the targets 8·sb, the loss's fp32 probabilities 4·sb·V/t
              offload.activations: the offloaded layers' full sets (`offloaded_layers` per
              chunk) move to host memory (`StagePlan.host`, weighted by the micro-batches in
              flight alike); the device keeps the received input of a chunk whose first layer
              is offloaded (the schedule holds it for its gradient, e·s'bh) and 2 layers' full
              sets in transit (a block being copied out, or restored plus the prefetched one)
  ZeRO-3 working set: the gathered units, ≈ 2 of the largest (current + prefetch) × e (+ one
              block per further chunk, whose last unit stays gathered), or the whole stage e·Ψ
              with parallel.reshard_after_forward=false

Not counted: the CUDA context and library workspaces, allocator fragmentation, communication
staging buffers, the gradient of the parameter being folded into G, compiled-graph buffers.

Communication per optimizer step and rank, ring wire bytes as `megalite.parallel.comm` counts
them (all-reduce 2(n−1)/n·S, reduce-scatter / all-gather (n−1)/n·S, send S), with S = e·sbh
a full activation:
  tp   per micro-batch and layer: 4 all-reduces; with SP 6 all-gathers + 4 reduce-scatters;
       each recomputed layer's forward re-run adds 1 all-reduce (SP: 2 all-gathers + 1
       reduce-scatter), as
       it stops once the saved tensors are rebuilt (before the MLP's reduction); the embedding, the
       LM head and the vocab-parallel loss (3 fp32 numbers per token); SP: one all-reduce of the
       TP-replicated gradients per step
  pp   per micro-batch and chunk: the activation forward and its gradient backward, e·s'bh
       each (a chunk that starts / ends the model receives / sends none); with TP and no SP
       1/t of it, the receiver all-gathering the rest over TP (+ (t−1)/t·e·sbh per received
       tensor on the tp group; Narayanan et al. 2021 §4.1)
  dp   zero 0: all-reduce 4Ψ; zero 1: reduce-scatter 4Ψ + all-gather e·Ψ; zero 2: m
       reduce-scatters + all-gather; zero 3: per micro-batch all-gathers of e·(2Ψ − each chunk's
       last unit, which stays gathered from forward into backward) + reduce-scatter 4Ψ
       (reshard_after_forward=false: one all-gather e·Ψ per step)
  embedding  pp > 1, first and last stage: all-reduce of the tied embedding's gradient, 4·Vh/t
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.parallel.schedule import max_in_flight, peak_live_bytes
from megalite.plan.chunks import stage_ends, ties_over_stages
from megalite.plan.dims import Dims, dims, ring
from megalite.plan.offload import apply_offload, optimizer_placement
from megalite.plan.stage_terms import StageSums, add_chunk, stage_comm
from megalite.plan.zero_table import (
    grad_staging_bytes,
    model_state_bytes,
)

GIB = 2**30


@dataclass
class StagePlan:
    stage: int
    layers: int
    params: int  # Ψ: parameter elements per rank
    in_flight: int  # micro-batches whose activations are held at once
    bytes: Dict[str, float] = field(default_factory=dict)  # P G O A zero3 total
    comm: Dict[str, float] = field(default_factory=dict)  # wire bytes per step per group
    host: Dict[str, float] = field(default_factory=dict)  # host memory: activations
    #                                                       optimizer total (plan_offload.py)
    pcie: Dict[str, float] = field(default_factory=dict)  # offload copies per step: d2h h2d


@dataclass
class Plan:
    layout: Dict[str, object]
    placement: Dict[str, str]
    stages: List[StagePlan]

    @property
    def peak(self) -> StagePlan:
        """The stage whose ranks need the most memory."""
        return max(self.stages, key=lambda s: s.bytes["total"])

    def as_dict(self) -> dict:
        return {"layout": self.layout, "placement": self.placement,
                "stages": [{"stage": s.stage, "layers": s.layers, "params": s.params,
                            "in_flight": s.in_flight, "bytes": s.bytes, "host": s.host,
                            "pcie": s.pcie, "comm": s.comm}
                           for s in self.stages]}

    def table(self) -> str:
        lay = self.layout
        unit, scale = ("GiB", GIB) if self.peak.bytes["total"] >= GIB else ("MiB", 2**20)
        partial = f" (first {lay['recompute_layers']} per stage)" \
            if lay["recompute"] and lay["recompute_layers"] is not None else ""
        virtual = f" virtual_stages={lay['virtual_stages']}" if lay["virtual_stages"] > 1 else ""
        offload = any(s.host["total"] for s in self.stages)
        limit = lay.get("offload_activations_layers")
        offloaded = "" if not lay.get("offload_activations") else \
            " offload.activations" + (f" (first {limit} per stage)" if limit is not None else "")
        if lay.get("offload_optimizer"):
            offloaded += f" offload.optimizer={lay['offload_optimizer']:g}"
        lines = [f"plan: {lay['model']}, tp={lay['tp']} pp={lay['pp']}{virtual} dp={lay['dp']} "
                 f"zero={lay['zero']} sp={lay['sp']} recompute={lay['recompute']}{partial}{offloaded}, "
                 f"{lay['dtype']}, micro-batch {lay['micro_batch']} x seq {lay['seq_len']}, "
                 f"m={lay['micro_batches']}",
                 "placement over DP: " + ", ".join(f"{k} {v}" for k, v in self.placement.items()),
                 f"{'stage':>5} {'layers':>6} {'params/rank':>12} {'P ' + unit:>7} "
                 f"{'G ' + unit:>7} {'O ' + unit:>7} {'A ' + unit:>7} {'(in flight)':>11} "
                 f"{'Z3 ' + unit:>7} {'total ' + unit:>9} "
                 f"{'tp GB':>8} {'pp GB':>7} {'dp GB':>7} {'emb GB':>7}"
                 + (f" {'host ' + unit:>8} {'PCIe GB':>8}" if offload else "")]
        for s in self.stages:
            b, c = s.bytes, s.comm
            lines.append(
                f"{s.stage:>5} {s.layers:>6} {s.params:>12,} {b['params'] / scale:>7.2f} "
                f"{(b['grads'] + b['grad_staging']) / scale:>7.2f} "
                f"{b['optimizer'] / scale:>7.2f} "
                f"{b['activations'] / scale:>7.2f} {s.in_flight:>11} "
                f"{b['zero3_gathered'] / scale:>7.2f} "
                f"{b['total'] / scale:>9.2f} {c['tp'] / 1e9:>8.3f} {c['pp'] / 1e9:>7.3f} "
                f"{c['dp'] / 1e9:>7.3f} {c['embedding'] / 1e9:>7.3f}"
                + (f" {s.host['total'] / scale:>8.2f} "
                   f"{(s.pcie['d2h'] + s.pcie['h2d']) / 1e9:>8.3f}" if offload else ""))
        lines.append("GB = 1e9 bytes sent per rank per optimizer step (ring wire bytes)"
                     + ("; host = offloaded optimizer state and activations per rank (host "
                        "memory), PCIe = their copies both ways per step" if offload else ""))
        return "\n".join(lines)


def memory_warning(plan: Plan, device_bytes: int) -> Optional[str]:
    """A warning when some stage's estimate exceeds the device's memory, else None."""
    worst = plan.peak
    if worst.bytes["total"] <= device_bytes:
        return None
    return (f"the plan estimates {worst.bytes['total'] / GIB:.1f} GiB per rank on pipeline "
            f"stage {worst.stage}, more than the device's {device_bytes / GIB:.1f} GiB: expect an "
            "out-of-memory error; raise zero, tp or pp, set train.recompute=true or lower "
            "train.micro_batch_size (megalite-plan shows the parts)")


def _stage_plan(d: Dims, k: int, chunk_blocks: List[range]) -> StagePlan:
    lay, slices = d.layout, d.layout.placement
    pp, dp, v = lay.pp_size, lay.dp_size, lay.virtual_stages
    schedule = d.cfg.parallel.schedule if pp > 1 else "auto"  # the order whose peaks count
    sums, ends = StageSums(), stage_ends(slices, k)
    for e, blocks in zip(ends, chunk_blocks):
        add_chunk(sums, d, e.first, e.last, len(blocks), e.head_copy)
    state = {**model_state_bytes(lay, sums.psi, d.e),
             "grad_staging": grad_staging_bytes(d, [(e, len(blocks))
                                               for e, blocks in zip(ends, chunk_blocks)]),
             "activations": peak_live_bytes(pp, k, d.micro, v, sums.chunk_act, schedule)
             + (2 * d.layer_act_full if any(sums.chunk_host) else 0.0)}
    state["zero3_gathered"] = 0.0 if not lay.shards_parameters or dp == 1 else (
        d.e * (2 * sums.largest_unit + (v - 1) * d.layer_params)
        if d.cfg.parallel.reshard_after_forward else d.e * sums.psi * ring(dp))
    host = {"activations": peak_live_bytes(pp, k, d.micro, v, sums.chunk_host, schedule)}
    pcie = apply_offload(d.cfg, lay, sums.psi, d.e, d.micro, state, host, sum(sums.chunk_host))
    state["total"] = sum(state.values())
    host["total"] = sum(host.values())
    tied = pp > 1 and ties_over_stages(slices, k)
    return StagePlan(k, sum(len(x) for x in chunk_blocks), sums.psi,
                     max_in_flight(pp, k, d.micro, v, schedule), state, stage_comm(d, sums, tied),
                     host, pcie)


def _placements(cfg: Config, layout: Layout) -> Dict[str, str]:
    """Each state's placement over DP (the design's vocabulary)."""
    t, dp = cfg.train, layout.dp_size
    kept = ("sharded over TP (SP)" if layout.sequence_parallel
            else "replicated over TP" if layout.tp_size > 1 else "kept")
    recomputed = ("materialized (recomputed)" if t.recompute and t.recompute_layers is None
                  else "partly recomputed" if t.recompute else "")
    limit = cfg.offload.activations_layers
    if cfg.offload.activations and recomputed != "materialized (recomputed)":
        blocks = "block" if limit == 1 else "blocks"
        which = (f" ({'the next' if t.recompute else 'the first'} {limit} {blocks} per stage)"
                 if limit is not None else " (the other blocks)" if t.recompute else "")
        activations = (f"{recomputed}, " if recomputed else "") + \
            f"offloaded{which} to host memory"
    else:
        activations = recomputed or kept
    return {
        "P": "sharded-with-gather" if layout.shards_parameters and dp > 1 else "replicated",
        "G": "sharded" if layout.shards_gradients and dp > 1 else "replicated",
        "O": optimizer_placement(cfg, "sharded" if layout.shards_optimizer and dp > 1
                                 else "replicated"),
        "A": activations,
    }


def make_plan(cfg: Config, layout: Layout) -> Plan:
    """The estimate for `cfg` under `layout` (which need not be this process's: the planner
    makes layouts for world sizes it does not run on)."""
    d = dims(cfg, layout)
    stages = [_stage_plan(d, k, chunk_blocks) for k, chunk_blocks in enumerate(
        layout.stage_blocks())]
    t = cfg.train
    described = {"model": cfg.model.name, **layout.as_dict(),
                 "recompute": t.recompute, "recompute_layers": t.recompute_layers,
                 "offload_activations": cfg.offload.activations,
                 "offload_activations_layers": cfg.offload.activations_layers,
                 "offload_optimizer": cfg.offload.optimizer,
                 "dtype": layout.precision, "micro_batch": t.micro_batch_size,
                 "seq_len": t.seq_len, "micro_batches": d.micro}
    return Plan(described, _placements(cfg, layout), stages)
