"""Predicted step time of a layout on a device profile, as a sum of named terms.

Per pipeline stage k (per rank of it), with m micro-batches per step, t = tp, b·s/cp tokens
per micro-batch on a rank (context parallelism splits each sequence over cp ranks; attention's
4·h·s a token still spans the whole sequence, so a rank's share of the causal work is 1/cp),
R the profile's achievable matmul FLOP/s in the run's precision, B its HBM bandwidth, e the
bytes of a model-dtype element:

  compute     m · 3·F_k·b·s / (cp·t·R)     F_k = model FLOPs per token of the stage's forward: 2 ×
              its blocks' parameters + 4·h·s per block (attention scores and values), the
              last stage the head's (GPT-2 2·(V·h + 2h): LM head, ln_f; the family's
              `head_forward_flops_per_token`): Σ_k 3·F_k = 6N + 12·L·h·s, the metrics'
              accounting (`flops_per_token`). Backward = 2 forwards. With fp8.recipe the
              blocks' linears (2 × the family's `fp8_linear_parameters` a block) run at the
              profile's fp8 rate (`matmul_seconds`; the casts to FP8 are in non_matmul)
              Under train.attention_mask=document each block's 4·h·s is charged × the
              masked kernel's factor w·ratio (`megalite.plan.document_terms`: w the work the
              kernel computes — FlexAttention's visible 128×128 blocks, the variable-length
              kernel's visible pairs, SDPA's dense causal work, under cp > 1 the CP kernel's
              unskipped work on the slowest rank — ratio its calibrated time per unit of
              work at R (the ring: 1; the all-gather path: SDPA's); the recompute too); MFU
              keeps the dense causal count
  recompute   m · r_k·(2·P_block + 4·h·s)·b·s / (t·R): one more forward of the r_k
              recomputed blocks (all, or train.recompute_layers of each chunk)
  non_matmul  m · (n_k + r_k/3) · (pass(h, b·s/t) + dropout): what a block's forward +
              backward costs beyond its FLOPs at R (elementwise ops, softmax, the attention
              kernel beyond its FLOPs, launches), as `--calibrate` measured a real block
              (megalite/plan/calibrate_block.py) at one or more widths: `block_pass_s`
              interpolates in the width between them (beyond them: the nearest, its per-token
              part × h / its width). `dropout` corrects for a run whose residual dropout is on
              where the measured block's was off, or off where it was on: 2 sites a block of
              b·s·h (/t with SP) elements at `DROPOUT_BYTES(e)` each over B (the attention
              probabilities' dropout, inside the SDPA kernel, is not modelled); the first
              stage adds the embedding's site. A recomputed block's re-run costs a third; it
              is compute: a third in the forward, the rest in the backward. fp8.recipe adds
              the casts' memory traffic, `cast_traffic_bytes` a block (and a re-run's
              forward third) over B (`megalite.plan.fp8_terms`: eager, or fused with
              train.compile; an estimate, unmeasured on a GPU)
  head_loss   last stage: m · b·s·V_t · `LOSS_BYTES_PER_LOGIT[impl]` / B: the loss's
              memory-bound work on the logits (the upcast, softmax and its gradient; the LM
              head's matmul is in compute, not here), V_t = the vocabulary (tp 1) or a rank's
              padded slice (vocab-parallel)
  grad_accumulate  m · Ψ_k·(e + 8) / B: the engine folds each micro-batch's e-byte gradients
              into fp32 (zero 2/3: + a zeroed fp32 buffer (4) and the owned part's fold
              (12/dp) a micro-batch), during the backward
  tp          the plan's TP wire bytes / bus bandwidth + collectives × each one's latency
              (`megalite.plan.links.collective_latency`: NCCL's ring model, its base + 2(n − 1)
              steps an all-reduce, n − 1 an all-gather or reduce-scatter): blocking, in the
              layer's critical path (megalite does not overlap TP collectives); all-reduces,
              with SP 6 all-gathers : 4 reduce-scatters a block (each kind at its own fit
              where a calibrated profile has one: `op_links`; pp: send/recv, dp: all-reduce,
              reduce-scatter, all-gather, embedding: all-reduce); fp8.recipe's amax
              all-reduces (GPT-2: 8 scalars a block tensorwise, 8 vectors rowwise; per
              FP8 linear: `megalite.plan.fp8_terms.amax_reductions`) at the all-reduce
              fit, their latency dominating
  cp          context parallelism's attention traffic on the CP group's link (inside a node
              while tp·cp <= GPUs per node): allgather's all-gather and reduce-scatter a layer
              exposed; the ring's K/V sends hidden under each step's chunk pairs up to their
              compute, its gradient accumulators' sends exposed (`megalite.plan.cp_terms`)
  offload     activation offload's copies (`megalite.plan.offload.activation_copies_exposed`:
              the runtime's schedule of each chunk's blocks on the compute stream and the
              two copy streams, simulated per micro-batch): each offloaded block's saved
              bytes out at d2h under the forward, back at h2d under the backward, with at
              most IN_TRANSIT blocks in transit beyond the room of the chunk's kept blocks;
              what the copies add to the chunk's forward + backward, × m. A block's time is
              its FLOPs at R (its attention × the document mask's factor, as in compute:
              the mask's saving leaves less compute to hide the copies under) + a third of
              `block_pass` (forward), twice that + two thirds (backward, + the gradient
              accumulation's share); the head and the loss are the compute between the last
              block's forward and its backward
  bubble      the stage's idle seconds in its schedule's own order of operations
              (`megalite.plan.pipeline_terms`, `megalite.plan.pipeline_sim`): every stage's
              busy = compute + recompute + non_matmul + head_loss + grad_accumulate + tp + cp
              + offload + ep + expert_imbalance cut into m·v forwards and backwards (ZB-H1 /
              ZB-V: B and W, W the linears' and the head's weight gradients and the
              accumulation) by its forward : backward times and its chunks' FLOPs, simulated
              as `stage_order` runs them (any m and v it accepts, uneven stages): the step
              without transfers less the stage's busy. With equal stages and unit times the
              schedules' formulas (`expected_bubble`); a heavier stage paces the pipeline
  pp          what the pipeline transfers (e·s'·b·h, 1/t of it with TP and no SP; posted
              ahead) add to the simulated step, each on the link it crosses (NVLink inside a
              node, one NIC rail across)
  dp          the plan's DP wire bytes (over DP x CP: the ranks reducing the same
              gradients), split into reduction (reduce / reduce-scatter of 4Ψ
              fp32 gradients) and gather (e·Ψ parameters). zero 0-1: each chunk's buckets
              reduced from the start of its last backward, one after another, exposed where
              they outlast the pipeline (the stage's idle end and later chunks' backwards
              hide them); zero 2-3: a reduce-scatter per micro-batch during its backward;
              zero 1-2: the gather after the step, or with parallel.overlap_param_gather each
              chunk's before its first forward ends (the stage's idle start hides it;
              `megalite.plan.pipeline_sim.DpWindows`); zero 3: each block gathered ahead
              (prefetch) during forward and backward, across the pipeline's operations too
              (`megalite.parallel.zero3`), as many all-gathers as the schedule's walk counts
              (`megalite.plan.zero3_gathers`)
  embedding   the tied embedding's gradient all-reduce (pp > 1), after backward
  ep, expert_imbalance, edp   expert parallelism (ep > 1, `megalite.plan.expert_time`): the
              token exchange on the link the folded EP group spans, blocking in each MoE
              layer; the busiest EP rank's extra routed-expert compute, (f − 1) × theirs,
              f = planner.moe_imbalance; the experts' reductions over EDP. ep and
              expert_imbalance are busy time (the bubble scales with them)
  optimizer   the engine's step on the device, memory-bound: `OPTIMIZER_BYTES` a parameter
              (the fp64-accumulated norm, clipping, fused AdamW, the master -> model-dtype
              copy) over Ψ_dev = the owned range less offload.optimizer's share, + the
              gradients zeroed (4 bytes each), over B
  offload_optimizer   offload.optimizer = f (n = f·Ψ_owned), as `megalite.parallel.offload`
              runs it (`megalite.plan.offload.optimizer_offload_s`): the gradient copies (4n
              per reduction at d2h) and the host worker's passes over them (the norm's
              squares; zero 2/3 each micro-batch's fold) under the backward, what exceeds it,
              + the last bucket's copy and squares after it; then the host step — the fused
              host AdamW at the rank's share of the node's rate (`host_adam_params_per_s` /
              ranks a node) and the cast (4 + e bytes a parameter at the memory rate AdamW
              reached, 28 bytes a parameter) range by range, the copies back (e·n at h2d)
              under the next range's update — less the next forward's first micro-batch,
              which waits block by block for its own ranges (not with zero 1/2's gather in
              the step)

Step time = the largest stage total; its terms sum to it. Not modelled: the embedding's
gather and its gradient, ln_f, the attention-probability dropout, the engine's per-step
Python, contention between groups sharing a link, stragglers, data loading, the first step's
compilation; a block measured eager is used as it is for a compiled run (and vice versa).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.model.families import flops_per_token
from megalite.plan.comm_time import dp_term
from megalite.plan.devices import DeviceProfile
from megalite.plan.document_terms import MaskedWork, mask_seconds, masking
from megalite.plan.links import group_links
from megalite.plan.pipeline_terms import pipeline_terms
from megalite.plan.stage_time import stage_forward_flops, stage_seconds
from megalite.plan.traffic_bytes import loss_implementation


@dataclass
class Prediction:
    step_s: float
    terms: Dict[str, float]  # seconds per step on the critical stage; they sum to step_s
    critical_stage: int
    critical_term: str
    tokens_per_s: float
    model_tflops_per_device: float  # 6N + 12·L·h·s per token, as the metrics' MFU
    hardware_tflops_per_device: float  # + recompute's extra forward
    mfu: Optional[float]  # model TFLOP/s / data-sheet peak (None without one)
    device: str
    stage_terms: List[Dict[str, float]]  # every stage's terms (the critical one's are `terms`)
    # train.attention_mask=document: the fractions assumed, the kernel, and the critical
    # stage's attention seconds a step with the mask and with causal attention (`masking`)
    document_mask: Optional[Dict[str, object]] = None

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        split = " ".join(f"{k} {v * 1e3:.1f}" for k, v in self.terms.items() if v > 0)
        mfu = f"{self.mfu:.1%}" if self.mfu is not None else "n/a (no data-sheet peak)"
        return (f"predicted on {self.device}: step {self.step_s:.4g} s, "
                f"{self.tokens_per_s:,.0f} tokens/s, {self.model_tflops_per_device:.1f} model "
                f"TFLOP/s/device (hardware {self.hardware_tflops_per_device:.1f}), MFU {mfu}; "
                f"critical: {self.critical_term} on stage {self.critical_stage}\n"
                f"  ms per step: {split}" + self._mask_line())

    def _mask_line(self) -> str:
        d = self.document_mask
        if d is None:
            return ""
        return (f"\n  {d['describe']}; kernel {d['kernel']} at {d['factor']:.3g}x the dense "
                f"causal attention's time: attention {d['attention_s'] * 1e3:.1f} ms per step "
                f"on stage {self.critical_stage} (causal: {d['attention_causal_s'] * 1e3:.1f} ms)"
                + _measured_kernels(d.get("measured", {})))


def _measured_kernels(factors: Dict[str, float]) -> str:
    """The profile's measured document-mask kernels at this corpus, fastest first."""
    if len(factors) < 2:
        return ""
    ranked = sorted(factors.items(), key=lambda kv: kv[1])
    return "\n  measured kernels for these documents (train.document_kernel): " + ", ".join(
        f"{k} {f:.3g}x" for k, f in ranked)


def predict(cfg: Config, layout: Layout, stages: Sequence, profile: DeviceProfile,
            gpus_per_node: int, loss: Optional[str] = None,
            masked_work: Optional[MaskedWork] = None) -> Prediction:
    """The predicted step of `layout` on `profile`; `stages`: per pipeline stage its
    parameters per rank and wire bytes per group (`Plan.stages`, or
    `megalite.plan.traffic.stage_traffic`); `loss`: a key of LOSS_BYTES_PER_LOGIT to model
    (default the run's, `loss_implementation`: a measurement of an older loss names its own);
    `masked_work`: under train.attention_mask=document, the fractions the mask leaves
    (default `NO_SAVING`)."""
    links = group_links(layout, profile, gpus_per_node)
    flops = stage_forward_flops(cfg, layout)
    chunks = layout.stage_blocks()
    loss = loss or loss_implementation(cfg, layout)
    mask = masking(cfg, layout, profile, masked_work)
    factor = mask["factor"] if mask else 1.0
    terms_k, passes = zip(*[stage_seconds(cfg, layout, stages[k], profile, links, k, chunks[k],
                                          flops[k], min(gpus_per_node, layout.world_size),
                                          loss, factor) for k in range(layout.pp_size)])
    pipe = pipeline_terms(cfg, layout, profile, gpus_per_node, terms_k, passes)
    for k, s in enumerate(terms_k):  # the schedule's idle time, transfers and DP windows
        s["bubble"], s["pp"] = pipe.bubble[k], pipe.pp[k]
        s["dp"] = dp_term(cfg, layout, stages[k], links, passes[k], pipe.windows[k], chunks[k])
    totals = [sum(s.values()) for s in terms_k]
    k = max(range(len(terms_k)), key=totals.__getitem__)
    step, terms, world = totals[k], terms_k[k], layout.world_size
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    model_tflops = tokens / step * flops_per_token(cfg.model, cfg.train.seq_len) / world / 1e12
    hardware = model_tflops + tokens / step * sum(f["recompute"] for f in flops) / world / 1e12
    return Prediction(step_s=step, terms=terms, critical_stage=k,
                      critical_term=max(terms, key=terms.__getitem__),
                      tokens_per_s=tokens / step, model_tflops_per_device=model_tflops,
                      hardware_tflops_per_device=hardware,
                      mfu=model_tflops / profile.peak_tflops_bf16
                      if profile.peak_tflops_bf16 else None, device=profile.name,
                      stage_terms=list(terms_k),
                      document_mask=mask_seconds(cfg, layout, profile, mask, chunks[k]))

