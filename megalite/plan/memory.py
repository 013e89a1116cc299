"""Before launch: what each rank will hold and send, from the configuration alone (Megatron's
theoretical memory report, with ZeRO's placement vocabulary).

For every pipeline stage, per rank (Ψ = parameter elements of the rank's TP slice of the stage,
vocabulary padded; N = DP x CP size, the ranks holding the same parameters; t = TP size;
m = micro-batches per step; e = bytes of the compute dtype, 2 for bf16 and fp16, 4 for fp32;
C = V/t padded columns; s = the rank's sequence positions, seq_len/cp; n = s·b tokens):

  P, G, O    `model_state_bytes` (the ZeRO table, `zero_table()`): parameters e·Ψ, fp32
              gradients 4·Ψ, AdamW moments 8·Ψ + fp32 master 4·Ψ where e < 4; /N where sharded
  A activations   per micro-batch × micro-batches in flight, min(pp − stage, m) under 1F1B;
              interleaved (v chunks): the peak over the stage's order of the alive chunks'
              bytes (`megalite.parallel.schedule.peak_live_bytes`)
              per layer (Korthikanti et al. 2022, with fused attention and no stored scores):
                e·sbh(4 + 12/t)   TP         e·sbh·16/t   TP + SP
                + 16·s'b (LayerNorm mean/rstd) + 4·(a/t)·sb (attention log-sum-exp)
                + 2·s'bh (residual dropout masks, resid_pdrop > 0)      s' = s/t with SP
              SDPA's math kernel (attention dropout on a CPU, train.attention=math): no
                log-sum-exp, + 3·e·b(a/t)s² (probabilities, dropout mask, dropped) + 2·e·sbh/t
              each block its own (the family's `block_activation_bytes`): an MoE model's
                dense blocks (model.moe.first_dense_layers / layer_freq) a dense block's, its
                MoE blocks the MoE layer's (`MixtralFamily.moe_layer_bytes`: TP-split experts
                on the TP-gathered tokens; EP folded over TP whole experts on the rank's own)
              context parallelism (cp > 1): + what CP attention saves beyond these at s/cp
                positions (`megalite.plan.cp_terms`: the gathered K/V under
                allgather, the fp32 merged output under ring); its working bytes at their
                peak (the gathered K/V or the ring's blocks in flight, partial outputs and a
                chunk pair's scores) in the forward and a block's backward moments
              recompute: e·s'bh per recomputed layer (the block input); one layer's full set
              while it is re-run (the backward moment); train.recompute_layers = r: r layers
              of each stage recomputed, the others keep their full set
              first stage: token ids 8·sb (+ embedding dropout mask); last stage: ln_f input and
              output e·s'bh each, its statistics 8·s'b, and what the chunked loss saves: the
              logits e·n·C and 17 bytes a token (21 with TP) (`megalite.plan.dims.loss_bytes`)
              offload.activations: the offloaded layers' full sets (`offloaded_layers` per
              chunk) move to host memory (`StagePlan.host`, weighted by the micro-batches in
              flight alike); the device keeps the received input of a chunk whose first layer
              is offloaded (the schedule holds it for its gradient, e·s'bh) and 2 layers' full
              sets in transit (a block being copied out, or restored plus the prefetched one)

The peak, what is alive at each moment where a stage's memory can peak, and the peak moment's
terms (P + G + O + A + ZeRO-3 gathered + staging + working bytes): `megalite.plan.peak_moments`.

Not counted: the CUDA context and library workspaces (cuBLAS, the attention kernels'
accumulators), allocator fragmentation and block rounding, compiled-graph buffers, the Python
heap. What a run measures against it: docs/planner.md (CPU, every moment; the H100 runs).

Communication per optimizer step and rank, ring wire bytes as `megalite.parallel.comm` counts
them (all-reduce 2(n−1)/n·S, reduce-scatter / all-gather (n−1)/n·S, send S), with S = e·sbh
a full activation:
  tp   per micro-batch and layer: 4 all-reduces; with SP 6 all-gathers + 4 reduce-scatters;
       each recomputed layer's forward re-run adds 1 all-reduce (SP: 2 all-gathers + 1
       reduce-scatter), as
       it stops once the saved tensors are rebuilt (before the MLP's reduction); the embedding, the
       LM head and the vocab-parallel loss (3 fp32 numbers per token); SP: one all-reduce of the
       TP-replicated gradients per step; KV heads shared by k TP ranks (tp > n_kv_head): one
       all-reduce per step of tp/k slots of their fp32 gradients; an MoE layer (SP) in place
       of the MLP's: its tokens gathered and outputs reduce-scattered and the choices (int64)
       and weights (fp32) gathered, or with EP folded over TP the choices only (+ the shared
       experts' tokens) (`stage_terms.moe_tp_bytes`); the step's routing figures (fp64)
       all-reduced over TP, DP x CP and PP (`stage_terms.routing_figure_bytes`)
  cp   per micro-batch and layer (`megalite.plan.cp_terms`): allgather, an all-gather of K|V
       and a reduce-scatter of its gradient; ring, cp − 1 K/V block sends forward, as many +
       cp fp32 gradient-accumulator sends backward; a recomputed layer repeats its forward's
  pp   per micro-batch and chunk: the activation forward and its gradient backward, e·s'bh
       each (a chunk that starts / ends the model receives / sends none); with TP and no SP
       1/t of it, the receiver all-gathering the rest over TP (+ (t−1)/t·e·sbh per received
       tensor on the tp group; Narayanan et al. 2021 §4.1)
  dp   over the DP x CP ranks: zero 0: all-reduce 4Ψ; zero 1: reduce-scatter 4Ψ + all-gather e·Ψ; zero 2: m
       reduce-scatters + all-gather; zero 3: per micro-batch all-gathers of e·(2Ψ − each chunk's
       last unit, which stays gathered from forward into backward) + reduce-scatter 4Ψ
       (reshard_after_forward=false: one all-gather e·Ψ per step)
  embedding  pp > 1, first and last stage: all-reduce of the tied embedding's gradient, 4·Vh/t
  edp, ep    ep > 1: dp's reductions of the routed experts' Ψ_E (E/ep a rank, their states
       sharded over EDP) over EDP instead; the token exchange over EP per MoE layer and
       micro-batch (`stage_terms.dispatch_bytes`; a recomputed layer's forward exchange
       again); each + the grad norm's fp64 sum
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

from megalite.config.layout import Layout
from megalite.config.schema import DEFAULT_RANK_ORDER, Config
from megalite.parallel.schedule import max_in_flight, peak_live_bytes, unwaited_sends
from megalite.plan.chunks import stage_ends, ties_over_stages
from megalite.plan.dims import Dims, dims
from megalite.plan.offload import apply_offload, optimizer_placement
from megalite.plan.peak_moments import MOMENTS, stage_moments
from megalite.plan.stage_terms import (
    StageSums,
    add_chunk,
    stage_comm,
    zero3_gathered,
)
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
    peak_at: str = "loss backward"  # the moment whose bytes `bytes` lists (MOMENTS)
    moments: Dict[str, Dict[str, float]] = field(default_factory=dict)  # every moment's bytes
    declared_staging: float = 0.0  # zero 2/3: the staging the engine declares (its bound)
    gathers: int = 0  # ZeRO-3's unit all-gathers a step (`zero3_gathered`)


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
                            "in_flight": s.in_flight, "bytes": s.bytes, "peak_at": s.peak_at,
                            "host": s.host,
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
        cp = f" cp={lay['cp']} ({lay['cp_comm']})" if lay["cp"] > 1 else ""
        experts = lay.get("ep", 1) > 1
        cp += f" ep={lay['ep']} ({lay['ep_dispatch']})" if experts else ""
        order = lay.get("rank_order", DEFAULT_RANK_ORDER)
        ordered = f" rank_order={order}" if order != DEFAULT_RANK_ORDER else ""
        lines = [f"plan: {lay['model']}, tp={lay['tp']}{cp} pp={lay['pp']}{virtual} dp={lay['dp']}{ordered} "
                 f"zero={lay['zero']} sp={lay['sp']} recompute={lay['recompute']}{partial}{offloaded}, "
                 f"{lay['dtype']}, micro-batch {lay['micro_batch']} x seq {lay['seq_len']}, "
                 f"m={lay['micro_batches']}",
                 f"placement over DP{' x CP' if cp else ''}: "
                 + ", ".join(f"{k} {v}" for k, v in self.placement.items()),
                 f"{'stage':>5} {'layers':>6} {'params/rank':>12} {'P ' + unit:>7} "
                 f"{'G ' + unit:>7} {'O ' + unit:>7} {'A ' + unit:>7} {'(in flight)':>11} "
                 f"{'Z3 ' + unit:>7} {'W ' + unit:>7} {'total ' + unit:>9} {'peak at':>14} "
                 f"{'tp GB':>8} {'cp GB':>7} {'pp GB':>7} {'dp GB':>7} {'emb GB':>7}"
                 + (f" {'edp GB':>7} {'ep GB':>7}" if experts else "")
                 + (f" {'host ' + unit:>8} {'PCIe GB':>8}" if offload else "")]
        for s in self.stages:
            b, c = s.bytes, s.comm
            lines.append(
                f"{s.stage:>5} {s.layers:>6} {s.params:>12,} {b['params'] / scale:>7.2f} "
                f"{(b['grads'] + b['grad_staging']) / scale:>7.2f} "
                f"{b['optimizer'] / scale:>7.2f} "
                f"{b['activations'] / scale:>7.2f} {s.in_flight:>11} "
                f"{b['zero3_gathered'] / scale:>7.2f} {b['working'] / scale:>7.2f} "
                f"{b['total'] / scale:>9.2f} {s.peak_at:>14} {c['tp'] / 1e9:>8.3f} "
                f"{c['cp'] / 1e9:>7.3f} {c['pp'] / 1e9:>7.3f} "
                f"{c['dp'] / 1e9:>7.3f} {c['embedding'] / 1e9:>7.3f}"
                + (f" {c['edp'] / 1e9:>7.3f} {c['ep'] / 1e9:>7.3f}" if experts else "")
                + (f" {s.host['total'] / scale:>8.2f} "
                   f"{(s.pcie['d2h'] + s.pcie['h2d']) / 1e9:>8.3f}" if offload else ""))
        lines.append("each stage's bytes at the moment its memory peaks (peak at: forward, loss "
                     "backward, backward, optimizer step); W = that moment's working bytes; "
                     "GB = 1e9 bytes sent per rank per optimizer step (ring wire bytes)"
                     + ("; host = offloaded optimizer state and activations per rank (host "
                        "memory), PCIe = their copies both ways per step" if offload else ""))
        return "\n".join(lines)


def memory_warning(plan: Plan, device_bytes: int) -> Optional[str]:
    """A warning when some stage's estimate exceeds the device's memory, else None."""
    worst = plan.peak
    if worst.bytes["total"] <= device_bytes:
        return None
    return (f"the plan estimates {worst.bytes['total'] / GIB:.1f} GiB per rank on pipeline "
            f"stage {worst.stage} (at its {worst.peak_at}), more than the device's "
            f"{device_bytes / GIB:.1f} GiB: expect an out-of-memory error; raise zero, tp or pp, "
            "set train.recompute=true, raise cp (a long sequence) or lower train.micro_batch_size "
            "(megalite-plan shows the parts)")


def _stage_plan(d: Dims, k: int, chunk_blocks: List[range]) -> StagePlan:
    lay, slices = d.layout, d.layout.placement
    pp, v = lay.pp_size, lay.virtual_stages
    schedule = d.cfg.parallel.schedule if pp > 1 else "auto"  # the order whose peaks count
    tied_family = d.cfg.model.tie_word_embeddings
    sums, ends = StageSums(), stage_ends(slices, k, tied_family)
    for e, blocks in zip(ends, chunk_blocks):
        add_chunk(sums, d, e.first, e.last, len(blocks), e.head_copy, blocks)
    chunks = [(replace(e, blocks=blocks), len(blocks)) for e, blocks in zip(ends, chunk_blocks)]
    states = _state_bytes(lay, sums, d.e)
    activations = peak_live_bytes(pp, k, d.micro, v, sums.chunk_act, schedule) \
        + (2 * d.layer_act_full if any(sums.chunk_host) else 0.0)
    host = {"activations": peak_live_bytes(pp, k, d.micro, v, sums.chunk_host, schedule)}
    pcie = apply_offload(d.cfg.offload.optimizer, lay, sums.psi, d.e, d.micro, states, host,
                         sum(sums.chunk_host), sums.expert_psi)
    host["total"] = sum(host.values())
    # gloo: the tensors sent in rounds that receive nothing are kept until the step's end
    sent = unwaited_sends(pp, k, d.micro, v, schedule) * d.e * d.s_local \
        * d.cfg.train.micro_batch_size * d.cfg.model.n_embd / _scatter(lay) \
        if pp > 1 and lay.device_type != "cuda" else 0.0
    moments = stage_moments(d, sums, chunks, states, activations, sent)
    peak_at = max(MOMENTS, key=lambda name: moments[name]["total"])
    tied = pp > 1 and ties_over_stages(slices, k, tied_family)
    plan = StagePlan(k, sum(len(x) for x in chunk_blocks), sums.psi,
                     max_in_flight(pp, k, d.micro, v, schedule), dict(moments[peak_at]),
                     stage_comm(d, sums, tied, k), host, pcie)
    plan.peak_at, plan.moments = peak_at, moments
    plan.declared_staging = grad_staging_bytes(d, chunks)
    plan.gathers = zero3_gathered(d, sums, k)[2] if lay.zero_stage == 3 else 0
    return plan


def _state_bytes(lay, sums: StageSums, e: int) -> Dict[str, float]:
    """The ZeRO table's bytes of the stage's Ψ: with expert parallelism the routed experts'
    Ψ_E (E/ep a rank) sharded over EDP, the rest over DP x CP."""
    states = model_state_bytes(lay, sums.psi - sums.expert_psi, e)
    if sums.expert_psi:
        experts = model_state_bytes(lay, sums.expert_psi, e, lay.expert_grad_replicas)
        states = {kind: value + experts[kind] for kind, value in states.items()}
    return states


def _scatter(lay) -> int:
    """With TP and no SP a pipeline transfer is 1/tp of the activation (gathered after)."""
    return lay.tp_size if lay.tp_size > 1 and not lay.sequence_parallel else 1


def _placements(cfg: Config, layout: Layout) -> Dict[str, str]:
    """Each state's placement over DP x CP (the design's vocabulary)."""
    t, dp = cfg.train, layout.grad_replicas
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
        "O": optimizer_placement(cfg.offload.optimizer, "sharded"
                                 if layout.shards_optimizer and dp > 1 else "replicated"),
        "A": activations,
    }


def make_plan(cfg: Config, layout: Layout) -> Plan:
    """The estimate for `cfg` under `layout` (which need not be this process's: the planner
    makes layouts for world sizes it does not run on)."""
    placements = _placements(cfg, layout)
    d = dims(cfg, layout)
    stages = [_stage_plan(d, k, chunk_blocks) for k, chunk_blocks in enumerate(
        layout.stage_blocks())]
    t = cfg.train
    described = {"model": cfg.model.name, **layout.as_dict(), "cp_comm": cfg.parallel.cp_comm,
                 "ep_dispatch": cfg.parallel.ep_dispatch,
                 "recompute": t.recompute, "recompute_layers": t.recompute_layers,
                 "offload_activations": cfg.offload.activations,
                 "offload_activations_layers": cfg.offload.activations_layers,
                 "offload_optimizer": cfg.offload.optimizer,
                 "dtype": layout.precision, "micro_batch": t.micro_batch_size,
                 "seq_len": t.seq_len, "micro_batches": d.micro}
    return Plan(described, placements, stages)
