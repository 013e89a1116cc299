"""Before launch: what each rank will hold and send, from the configuration alone (Megatron's
theoretical memory report, with ZeRO's placement vocabulary).

For every pipeline stage, per rank (Ψ = parameter elements of the rank's TP slice of the stage,
vocabulary padded; N = DP size; t = TP size; m = micro-batches per step; e = bytes of the
compute dtype, 2 for bf16 and fp16, 4 for fp32):

  state       bytes                                     placement
  P params    e·Ψ   (zero 3: e·Ψ/N)                     replicated | sharded-with-gather (zero 3)
  G grads     4·Ψ   (zero 2, 3: 4·Ψ/N)                  fp32 accumulation; replicated | sharded
  O optimizer (8 + 4 if e < 4)·Ψ   (zero >= 1: /N)      AdamW moments (+ fp32 master)
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
       each (a chunk that starts / ends the model receives / sends none)
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
from megalite.parallel.param_spec import padded_vocab_size
from megalite.parallel.schedule import max_in_flight, peak_live_bytes

GIB = 2**30


@dataclass
class StagePlan:
    stage: int
    layers: int
    params: int  # Ψ: parameter elements per rank
    in_flight: int  # micro-batches whose activations are held at once
    bytes: Dict[str, float] = field(default_factory=dict)  # P G O A zero3 total
    comm: Dict[str, float] = field(default_factory=dict)  # wire bytes per step per group


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
                            "in_flight": s.in_flight, "bytes": s.bytes, "comm": s.comm}
                           for s in self.stages]}

    def table(self) -> str:
        lay = self.layout
        unit, scale = ("GiB", GIB) if self.peak.bytes["total"] >= GIB else ("MiB", 2**20)
        partial = f" (first {lay['recompute_layers']} per stage)" \
            if lay["recompute"] and lay["recompute_layers"] is not None else ""
        virtual = f" virtual_stages={lay['virtual_stages']}" if lay["virtual_stages"] > 1 else ""
        lines = [f"plan: {lay['model']}, tp={lay['tp']} pp={lay['pp']}{virtual} dp={lay['dp']} "
                 f"zero={lay['zero']} sp={lay['sp']} recompute={lay['recompute']}{partial}, "
                 f"{lay['dtype']}, micro-batch {lay['micro_batch']} x seq {lay['seq_len']}, "
                 f"m={lay['micro_batches']}",
                 "placement over DP: " + ", ".join(f"{k} {v}" for k, v in self.placement.items()),
                 f"{'stage':>5} {'layers':>6} {'params/rank':>12} {'P ' + unit:>7} "
                 f"{'G ' + unit:>7} {'O ' + unit:>7} {'A ' + unit:>7} {'(in flight)':>11} "
                 f"{'Z3 ' + unit:>7} {'total ' + unit:>9} "
                 f"{'tp GB':>8} {'pp GB':>7} {'dp GB':>7} {'emb GB':>7}"]
        for s in self.stages:
            b, c = s.bytes, s.comm
            lines.append(
                f"{s.stage:>5} {s.layers:>6} {s.params:>12,} {b['params'] / scale:>7.2f} "
                f"{b['grads'] / scale:>7.2f} {b['optimizer'] / scale:>7.2f} "
                f"{b['activations'] / scale:>7.2f} {s.in_flight:>11} "
                f"{b['zero3_gathered'] / scale:>7.2f} "
                f"{b['total'] / scale:>9.2f} {c['tp'] / 1e9:>8.3f} {c['pp'] / 1e9:>7.3f} "
                f"{c['dp'] / 1e9:>7.3f} {c['embedding'] / 1e9:>7.3f}")
        lines.append("GB = 1e9 bytes sent per rank per optimizer step (ring wire bytes)")
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


def make_plan(cfg: Config, layout: Layout) -> Plan:
    """The estimate for `cfg` under `layout` (which need not be this process's: the planner
    makes layouts for world sizes it does not run on)."""
    m, t_cfg = cfg.model, cfg.train
    tp, pp, dp = layout.tp_size, layout.pp_size, layout.dp_size
    zero, sp = layout.zero_stage, layout.sequence_parallel
    micro = layout.micro_batches(t_cfg.global_batch_size)
    dtype = layout.precision
    e = 4 if dtype == "fp32" else 2
    h, f, a = m.n_embd, m.ffn_size, m.n_head
    vocab = padded_vocab_size(m.vocab_size, tp)
    s, b = t_cfg.seq_len, t_cfg.micro_batch_size
    s_local = s // tp if sp else s
    sbh = s * b * h
    dropout = m.resid_pdrop > 0

    layer_act_full = layer_activation_bytes(s, b, h, a, tp, sp, e, dropout)
    layer_params = (4 * h + (3 * h * h + 3 * h) // tp + h * h // tp + h
                    + (f * h + f) // tp + h * f // tp + h)
    layer_replicated = 6 * h  # LayerNorms and the row-parallel biases

    v = layout.virtual_stages
    full = e * sbh  # one full activation [s, b, h]
    r, rd = _ring(tp), _ring(dp)
    shard = dp if zero >= 1 else 1
    stages = []
    for k, chunk_blocks in enumerate(stage_chunks(m.n_layer, pp, v,
                                                  cfg.parallel.edge_stage_layers)):
        psi = replicated = largest_unit = kept_units = 0
        sends = tp_per_micro = 0.0
        chunk_act: List[float] = []
        for c, blocks in enumerate(chunk_blocks):
            # a chunk holds the embeddings / the head when it is the model's first / last slice
            first, last, n = k == 0 and c == 0, k == pp - 1 and c == v - 1, len(blocks)
            psi += n * layer_params
            replicated += n * layer_replicated
            if first:
                psi += vocab // tp * h + m.n_positions * h
                replicated += m.n_positions * h
            if last:
                psi += 2 * h + (0 if first else vocab // tp * h)
                replicated += 2 * h
            largest_unit = max(largest_unit, layer_params if n else 0,
                               vocab // tp * h if (first or last) else 0)

            recomputed = recomputed_layers(cfg, n)
            act = (recomputed * e * s_local * b * h + (n - recomputed) * layer_act_full
                   + (layer_act_full if recomputed else 0))
            if first:
                act += 8 * s * b + (s_local * b * h if m.embd_pdrop > 0 else 0)
            if last:
                act += 2 * e * s_local * b * h + 8 * s_local * b + 8 * s * b + 4 * s * b * (
                    m.vocab_size if tp == 1 else vocab // tp) + (s * b if tp > 1 else 0)
            chunk_act.append(act)

            if tp > 1:
                # recompute's re-run stops once the saved tensors are rebuilt (torch
                # checkpoint's early stop): the MLP output's reduction is not repeated
                per_layer, rerun = (10 * r * full, 3 * r * full) if sp else \
                    (4 * 2 * r * full, 2 * r * full)
                tp_per_micro += n * per_layer + recomputed * rerun
                if first:
                    tp_per_micro += 2 * r * full  # embedding: all-reduce, or RS + all-gather
                if last:
                    tp_per_micro += (3 if sp else 2) * r * full + 2 * r * 12 * s * b  # head, loss
            sends += (0 if last else 1) + (0 if first else 1)
            # ZeRO-3 keeps a chunk's last unit gathered from its forward into its backward
            # (with pp = 1 that is the tied embedding, gathered twice in forward: no saving)
            kept_units += layer_params if not last else 0 if first else vocab // tp * h

        state = {
            "params": e * psi / (dp if zero == 3 else 1),
            "grads": 4 * psi / (dp if zero >= 2 else 1),
            "optimizer": (8 + (4 if e < 4 else 0)) * psi / shard,
            "activations": peak_live_bytes(pp, k, micro, v, chunk_act),
        }
        state["zero3_gathered"] = 0.0 if zero != 3 or dp == 1 else (
            e * (2 * largest_unit + (v - 1) * layer_params) if cfg.parallel.reshard_after_forward
            else e * psi * _ring(dp))
        state["total"] = sum(state.values())

        tp_bytes = micro * tp_per_micro + (2 * r * 4 * replicated / shard if sp else 0) \
            if tp > 1 else 0.0
        pp_bytes = float(micro * sends * e * s_local * b * h) if pp > 1 else 0.0
        dp_bytes = {0: 2 * rd * 4 * psi,
                    1: rd * (4 + e) * psi,
                    2: rd * (micro * 4 + e) * psi,
                    3: rd * micro * (4 * psi + e * (2 * psi - kept_units))
                    if cfg.parallel.reshard_after_forward
                    else rd * (micro * 4 + e) * psi}[zero] if dp > 1 else 0.0
        tied = pp > 1 and k in (0, pp - 1)
        emb_bytes = 4 * (vocab // tp * h) / shard if tied else 0.0
        stages.append(StagePlan(k, sum(len(x) for x in chunk_blocks), psi,
                                max_in_flight(pp, k, micro, v), state,
                                {"tp": tp_bytes, "pp": pp_bytes, "dp": dp_bytes,
                                 "embedding": emb_bytes}))

    placement = {
        "P": "sharded-with-gather" if zero == 3 and dp > 1 else "replicated",
        "G": "sharded" if zero >= 2 and dp > 1 else "replicated",
        "O": "sharded" if zero >= 1 and dp > 1 else "replicated",
        "A": ("materialized (recomputed)" if t_cfg.recompute and t_cfg.recompute_layers is None
              else "partly recomputed" if t_cfg.recompute else
              "sharded over TP (SP)" if sp else "replicated over TP" if tp > 1 else "kept"),
    }
    described = {"model": m.name, **layout.as_dict(),
                 "recompute": t_cfg.recompute, "recompute_layers": t_cfg.recompute_layers,
                 "dtype": dtype, "micro_batch": b, "seq_len": s, "micro_batches": micro}
    return Plan(described, placement, stages)
