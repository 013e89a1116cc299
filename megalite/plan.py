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

from megalite.config import Config
from megalite.layout import Layout, stage_chunks
from megalite.model.activation_offload import offloaded_blocks
from megalite.parallel.param_spec import padded_vocab_size
from megalite.parallel.schedule import max_in_flight, peak_live_bytes
from megalite.plan_chunks import stage_ends, ties_over_stages
from megalite.plan_offload import apply_offload, optimizer_placement
from megalite.zero_table import (  # noqa: F401  (the ZeRO table's home; plan re-exports it)
    ZERO_DP_TRAFFIC,
    chunk_param_sizes,
    dp_traffic_elements,
    grad_staging_bytes,
    model_state_bytes,
    zero_table,
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


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool, e: int,
                           dropout: bool = False) -> float:
    """Bytes one transformer layer keeps for backward per micro-batch (the module docstring's
    formula): e·sbh(4 + 12/t), or e·sbh·16/t with SP, + LayerNorm statistics, the attention
    log-sum-exp and, with dropout, the residual dropout masks."""
    s_local = s // t if sp else s
    main = e * s * b * h * (16 / t if sp else 4 + 12 / t)
    return main + 16 * s_local * b + 4 * (a // t) * s * b + (2 * s_local * b * h if dropout else 0)


def memory_warning(plan: Plan, device_bytes: int) -> Optional[str]:
    """A warning when some stage's estimate exceeds the device's memory, else None."""
    worst = plan.peak
    if worst.bytes["total"] <= device_bytes:
        return None
    return (f"the plan estimates {worst.bytes['total'] / GIB:.1f} GiB per rank on pipeline "
            f"stage {worst.stage}, more than the device's {device_bytes / GIB:.1f} GiB: expect an "
            "out-of-memory error; raise zero, tp or pp, set train.recompute=true or lower "
            "train.micro_batch_size (megalite-plan shows the parts)")


def _ring(n: int) -> float:
    return (n - 1) / n


def recomputed_layers(cfg: Config, stage_layers: int) -> int:
    """How many of a stage's blocks re-run their forward in backward."""
    if not cfg.train.recompute:
        return 0
    limit = cfg.train.recompute_layers
    return stage_layers if limit is None else min(limit, stage_layers)


def offloaded_layers(cfg: Config, stage_layers: int) -> int:
    """How many of a chunk's blocks keep their saved tensors in host memory."""
    if not cfg.offload.activations:
        return 0
    return len(offloaded_blocks(stage_layers, recomputed_layers(cfg, stage_layers),
                                cfg.offload.activations_layers))


@dataclass(frozen=True)
class _Dims:
    """The sizes every term of a plan is built from."""

    cfg: Config
    layout: Layout
    e: int  # bytes of the compute dtype
    vocab: int  # padded vocabulary
    s_local: int  # positions of the residual stream per rank (s/t with SP)
    micro: int  # micro-batches per step
    layer_act_full: float  # activation bytes one layer keeps (no recompute)
    layer_params: int  # parameter elements of one block on one TP rank
    full: float  # bytes of one full activation [s, b, h]


def _dims(cfg: Config, layout: Layout) -> _Dims:
    m, t, tp = cfg.model, cfg.train, layout.tp_size
    e = 4 if layout.precision == "fp32" else 2
    h, f = m.n_embd, m.ffn_size
    return _Dims(
        cfg=cfg, layout=layout, e=e, vocab=padded_vocab_size(m.vocab_size, tp),
        s_local=layout.activation_seq_len(t.seq_len),
        micro=layout.micro_batches(t.global_batch_size),
        layer_act_full=layer_activation_bytes(t.seq_len, t.micro_batch_size, h, m.n_head, tp,
                                              layout.sequence_parallel, e, m.resid_pdrop > 0),
        layer_params=(4 * h + (3 * h * h + 3 * h) // tp + h * h // tp + h
                      + (f * h + f) // tp + h * f // tp + h),
        full=e * t.seq_len * t.micro_batch_size * h)


@dataclass
class _StageSums:
    """What a stage's chunks add up to."""

    psi: int = 0  # parameter elements
    replicated: int = 0  # of which TP-replicated (LayerNorms, row-parallel biases, wpe)
    largest_unit: int = 0  # ZeRO-3's largest gathered unit
    kept_units: int = 0  # ZeRO-3 units kept gathered from forward into backward
    sends: float = 0.0  # point-to-point tensors per micro-batch
    tp_per_micro: float = 0.0  # TP wire bytes per micro-batch
    chunk_act: List[float] = field(default_factory=list)  # activation bytes per chunk
    chunk_host: List[float] = field(default_factory=list)  # of which offloaded to host


def _add_chunk(sums: _StageSums, d: _Dims, first: bool, last: bool, n: int,
               head_copy: Optional[bool] = None) -> None:
    """One chunk of n blocks; `first` / `last`: it holds the embeddings / the head
    (`head_copy`: a parameter of its own, by default when not `first`; `plan_chunks`)."""
    head_copy = last and not first if head_copy is None else head_copy
    m, t, tp, sp = d.cfg.model, d.cfg.train, d.layout.tp_size, d.layout.sequence_parallel
    h, s, b, e = m.n_embd, t.seq_len, t.micro_batch_size, d.e
    sums.psi += n * d.layer_params
    sums.replicated += n * 6 * h  # LayerNorms and the row-parallel biases
    if first:
        sums.psi += d.vocab // tp * h + m.n_positions * h
        sums.replicated += m.n_positions * h
    if last:
        sums.psi += 2 * h + (d.vocab // tp * h if head_copy else 0)
        sums.replicated += 2 * h
    sums.largest_unit = max(sums.largest_unit, d.layer_params if n else 0,
                            d.vocab // tp * h if (first or last) else 0)
    recomputed = recomputed_layers(d.cfg, n)
    act = (recomputed * e * d.s_local * b * h + (n - recomputed) * d.layer_act_full
           + (d.layer_act_full if recomputed else 0))
    if first:
        act += 8 * s * b + (d.s_local * b * h if m.embd_pdrop > 0 else 0)
    if last:
        act += 2 * e * d.s_local * b * h + 8 * d.s_local * b + 8 * s * b + 4 * s * b * (
            m.vocab_size if tp == 1 else d.vocab // tp) + (s * b if tp > 1 else 0)
    offloaded = offloaded_layers(d.cfg, n)
    host = offloaded * d.layer_act_full
    if offloaded and not recomputed and not first:
        # the first block's input, copied to host, stays on the device too: the schedule
        # holds the received activation for its gradient
        act += e * d.s_local * b * h
    sums.chunk_act.append(act - host)
    sums.chunk_host.append(host)
    if tp > 1:
        r, full = _ring(tp), d.full
        # recompute's re-run stops once the saved tensors are rebuilt (torch
        # checkpoint's early stop): the MLP output's reduction is not repeated
        per_layer, rerun = (10 * r * full, 3 * r * full) if sp else \
            (4 * 2 * r * full, 2 * r * full)
        sums.tp_per_micro += n * per_layer + recomputed * rerun
        if first:
            sums.tp_per_micro += 2 * r * full  # embedding: all-reduce, or RS + all-gather
        if last:
            sums.tp_per_micro += (3 if sp else 2) * r * full + 2 * r * 12 * s * b  # head, loss
    sums.sends += (0 if last else 1) + (0 if first else 1)
    # ZeRO-3 keeps a chunk's last unit gathered from its forward into its backward
    # (with pp = 1 that is the tied embedding, gathered twice in forward: no saving)
    sums.kept_units += d.layer_params if not last else d.vocab // tp * h if head_copy else 0


def _stage_comm(d: _Dims, sums: _StageSums, tied: bool) -> Dict[str, float]:
    """Wire bytes per step per group of one rank of the stage."""
    lay, t, e, psi = d.layout, d.cfg.train, d.e, sums.psi
    tp, pp, dp, micro = lay.tp_size, lay.pp_size, lay.dp_size, d.micro
    r, rd = _ring(tp), _ring(dp)
    shard = dp if lay.shards_optimizer else 1
    # with TP and no SP each TP rank sends 1/tp of a transfer and the receiver all-gathers
    scatter = tp if tp > 1 and not lay.sequence_parallel and pp > 1 else 1
    tp_bytes = micro * sums.tp_per_micro + (
        2 * r * 4 * sums.replicated / shard if lay.sequence_parallel else 0) + (
        micro * sums.sends * r * d.full if scatter > 1 else 0) if tp > 1 else 0.0
    pp_bytes = float(micro * sums.sends * e * d.s_local * t.micro_batch_size
                     * d.cfg.model.n_embd) / scatter if pp > 1 else 0.0
    dp_bytes = {0: 2 * rd * 4 * psi,
                1: rd * (4 + e) * psi,
                2: rd * (micro * 4 + e) * psi,
                3: rd * micro * (4 * psi + e * (2 * psi - sums.kept_units))
                if d.cfg.parallel.reshard_after_forward
                else rd * (micro * 4 + e) * psi}[lay.zero_stage] if dp > 1 else 0.0
    emb_bytes = 4 * (d.vocab // tp * d.cfg.model.n_embd) / shard if tied else 0.0
    return {"tp": tp_bytes, "pp": pp_bytes, "dp": dp_bytes, "embedding": emb_bytes}


def _stage_plan(d: _Dims, k: int, chunk_blocks: List[range]) -> StagePlan:
    lay, slices = d.layout, d.layout.placement
    pp, dp, v = lay.pp_size, lay.dp_size, lay.virtual_stages
    schedule = d.cfg.parallel.schedule if pp > 1 else "auto"  # the order whose peaks count
    sums, ends = _StageSums(), stage_ends(slices, k)
    for e, blocks in zip(ends, chunk_blocks):
        _add_chunk(sums, d, e.first, e.last, len(blocks), e.head_copy)
    state = {**model_state_bytes(lay, sums.psi, d.e),
             "grad_staging": grad_staging_bytes(d, [(e, len(blocks))
                                               for e, blocks in zip(ends, chunk_blocks)]),
             "activations": peak_live_bytes(pp, k, d.micro, v, sums.chunk_act, schedule)
             + (2 * d.layer_act_full if any(sums.chunk_host) else 0.0)}
    state["zero3_gathered"] = 0.0 if not lay.shards_parameters or dp == 1 else (
        d.e * (2 * sums.largest_unit + (v - 1) * d.layer_params)
        if d.cfg.parallel.reshard_after_forward else d.e * sums.psi * _ring(dp))
    host = {"activations": peak_live_bytes(pp, k, d.micro, v, sums.chunk_host, schedule)}
    pcie = apply_offload(d.cfg, lay, sums.psi, d.e, d.micro, state, host, sum(sums.chunk_host))
    state["total"] = sum(state.values())
    host["total"] = sum(host.values())
    tied = pp > 1 and ties_over_stages(slices, k)
    return StagePlan(k, sum(len(x) for x in chunk_blocks), sums.psi,
                     max_in_flight(pp, k, d.micro, v, schedule), state, _stage_comm(d, sums, tied),
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
    d = _dims(cfg, layout)
    stages = [_stage_plan(d, k, chunk_blocks) for k, chunk_blocks in enumerate(
        stage_chunks(cfg.model.n_layer, layout.pp_size, layout.virtual_stages,
                     cfg.parallel.edge_stage_layers, layout.v_shape))]
    t = cfg.train
    described = {"model": cfg.model.name, **layout.as_dict(),
                 "recompute": t.recompute, "recompute_layers": t.recompute_layers,
                 "offload_activations": cfg.offload.activations,
                 "offload_activations_layers": cfg.offload.activations_layers,
                 "offload_optimizer": cfg.offload.optimizer,
                 "dtype": layout.precision, "micro_batch": t.micro_batch_size,
                 "seq_len": t.seq_len, "micro_batches": d.micro}
    return Plan(described, _placements(cfg, layout), stages)
