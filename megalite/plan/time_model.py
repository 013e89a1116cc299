"""Predicted step time of a layout on a device profile, as a sum of named terms.

Per pipeline stage k (per rank of it), with m micro-batches per step, t = tp, b·s tokens per
micro-batch, R the profile's achievable matmul FLOP/s in the run's precision:

  compute     m · 3·F_k·b·s / (t·R)       F_k = model FLOPs per token of the stage's forward: 2 ×
              its blocks' parameters + 4·h·s per block (attention scores and values), the
              last stage 2·(V·h + 2h) (LM head, ln_f): Σ_k 3·F_k = 6N + 12·L·h·s, the metrics'
              accounting (`flops_per_token`). Backward = 2 forwards.
  recompute   m · r_k·(2·P_block + 4·h·s)·b·s / (t·R): one more forward of the r_k
              recomputed blocks (all, or train.recompute_layers of each chunk)
  non_matmul  m · (n_k + r_k/3) · (fixed + per_token · b·s/t): what a block's forward +
              backward costs beyond its FLOPs at R (elementwise ops, softmax, per-operation
              launch and dispatch overhead), as `scripts/plan.py --calibrate` measured it on a
              real block (megalite/plan/calibrate_block.py; a recomputed block's re-run a third of
              it); 0 for the device table's entries, which do not measure it. It is compute:
              a third in the forward, the rest in the backward, which communication overlaps
  tp          the plan's TP wire bytes / bus bandwidth + collectives × latency: blocking, in the
              layer's critical path (megalite does not overlap TP collectives); all-reduces,
              with SP 6 all-gathers : 4 reduce-scatters a block (each kind at its own fit
              where a calibrated profile has one: `op_links`; pp: send/recv, dp: all-reduce,
              reduce-scatter, all-gather, embedding: all-reduce)
  offload     activation offload's copies (offloaded blocks' saved bytes, out in forward, back
              in backward) over the host link, on a side stream: only what exceeds the
              micro-batch's forward / backward time is exposed
  bubble      busy_max / (1 − β) − busy_k, β = `expected_bubble(pp, m, v, schedule)`:
              (p−1)/(v·m+p−1) for 1F1B and interleaved, (p−1)/(3m+p−1) for ZB-H1 (m ≥ p),
              (p−1)/(6m+p−1) for ZB-V (m ≥ (3p−1)/2; v = 2 in a V, so stage 0 holds the
              embeddings and the LM head and is usually the busiest) — their W's are the
              backward's weight half, no FLOPs of their own: compute is the same 3·F either
              way — and busy = compute + recompute + non_matmul + tp + offload: the slowest
              stage paces the pipeline; on it this is busy·β/(1 − β), the schedule's formula
  pp          pipeline transfers (e·s'·b·h, 1/t of it with TP and no SP): posted ahead, so
              exposed along the fill and drain (2(p·v − 1) transfers) and, in the steady
              state, only where a transfer outlasts a chunk's forward
  dp          the plan's DP wire bytes, split into reduction (reduce / reduce-scatter of 4Ψ
              fp32 gradients) and gather (e·Ψ parameters). zero 0-1: buckets reduced during
              the last micro-batch's backward (exposed: what exceeds it); zero 2-3: a
              reduce-scatter per micro-batch during its backward; zero 1-2: the gather after
              the step, or during the next forward with parallel.overlap_param_gather;
              zero 3: each block gathered ahead (prefetch) during forward and backward
  embedding   the tied embedding's gradient all-reduce (pp > 1), after backward
  optimizer   AdamW over the owned parameters on the device, memory-bound: (28 + e)·Ψ_dev /
              HBM bytes/s (Ψ_dev = the owned range less offload.optimizer's share)
  offload_optimizer   offload.optimizer = f (n = f·Ψ_owned): fp32 gradient copies to the host
              as reductions complete (4n per reduction, during the backward: what exceeds it),
              then the host AdamW ((28 + e)·n at the rank's host memory bandwidth) with the
              updated parameters copied back (e·n over the host link) bucket by bucket: the
              longer of the two

Step time = the largest stage total; its terms sum to it. Not modelled: the embedding's and
the head's (LM head, loss) non-matmul work, and without a calibrated profile the blocks' too
(the table's rates absorb what they can), the per-step Python of the engine (gradient norm,
clipping, zero_grad), contention between groups sharing a link, stragglers, data loading, the
first step's compilation.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from megalite.config.layout import Layout
from megalite.config.schedule_rules import expected_bubble
from megalite.config.schema import Config
from megalite.model.gpt2 import flops_per_token
from megalite.plan.devices import DeviceProfile
from megalite.plan.dims import layer_activation_bytes, offloaded_layers, recomputed_layers
from megalite.plan.links import GroupLink, group_links

TERMS = ("compute", "recompute", "non_matmul", "tp", "offload", "bubble", "pp", "dp", "embedding",
         "optimizer", "offload_optimizer")


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

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        split = " ".join(f"{k} {v * 1e3:.1f}" for k, v in self.terms.items() if v > 0)
        mfu = f"{self.mfu:.1%}" if self.mfu is not None else "n/a (no data-sheet peak)"
        return (f"predicted on {self.device}: step {self.step_s:.4g} s, "
                f"{self.tokens_per_s:,.0f} tokens/s, {self.model_tflops_per_device:.1f} model "
                f"TFLOP/s/device (hardware {self.hardware_tflops_per_device:.1f}), MFU {mfu}; "
                f"critical: {self.critical_term} on stage {self.critical_stage}\n"
                f"  ms per step: {split}")


def _block_params(cfg: Config) -> int:
    h, f = cfg.model.n_embd, cfg.model.ffn_size
    return 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)


def stage_forward_flops(cfg: Config, layout: Layout) -> List[Dict[str, float]]:
    """Per stage, forward FLOPs per token of the whole (untensor-split) stage: `model` and
    the `recompute` re-run."""
    m, s = cfg.model, cfg.train.seq_len
    block = 2 * _block_params(cfg) + 4 * m.n_embd * s
    place = layout.placement
    out = []
    for k, chunks in enumerate(layout.stage_blocks()):
        model = recompute = 0.0
        for c, blocks in enumerate(chunks):
            model += len(blocks) * block
            recompute += recomputed_layers(cfg, len(blocks)) * block
            if place.holds_last(k, c):
                model += 2 * (m.vocab_size * m.n_embd + 2 * m.n_embd)
        out.append({"model": model, "recompute": recompute})
    return out


def _ring_time(wire_bytes: float, collectives: float, link: GroupLink, ranks: int,
               op: str = "all_reduce") -> float:
    """Seconds of `collectives` collectives of kind `op` over `ranks` ranks moving
    `wire_bytes` in all: wire bytes at the bus bandwidth + the latency of each: a ring takes
    ranks − 1 steps, each the profile's latency (that of a 2-rank collective, its smallest
    group) — the kind's own fit where the profile has one (`op_links`), else the link's."""
    fit = link.of(op)
    return wire_bytes / (fit.bus_gbps * 1e9) + collectives * (ranks - 1) * fit.latency_s


def _tp_collectives(cfg: Config, layout: Layout, chunks: List[range], first: bool,
                    last: bool) -> float:
    """A stage's TP collectives per micro-batch (the plan's count: 4 all-reduces a layer, with
    SP 6 all-gathers + 4 reduce-scatters; a recomputed layer's re-run 1, with SP 3; the
    embedding and the head + loss a few more)."""
    if layout.tp_size == 1:
        return 0.0
    layers = sum(len(b) for b in chunks)
    rec = sum(recomputed_layers(cfg, len(b)) for b in chunks)
    per_layer, rerun = ((10, 3) if layout.sequence_parallel else (4, 1))
    return layers * per_layer + rec * rerun + 2 * first + 4 * last


def _dp_exposed(cfg: Config, layout: Layout, dp_bytes: float, psi: int, e: int, m: int,
                t_f: float, t_b: float, link: GroupLink, units: int) -> float:
    """Exposed DP time per step (module docstring)."""
    n = layout.dp_size
    if n == 1 or dp_bytes == 0:
        return 0.0
    ring = (n - 1) / n
    buckets = units if layout.zero_stage == 3 else \
        max(1.0, 4 * psi / (cfg.parallel.bucket_mb * 2**20))  # collectives per pass
    zero = layout.zero_stage
    if zero == 0:
        return max(0.0, _ring_time(dp_bytes, buckets, link, n, "all_reduce") - t_b)
    per_micro = zero >= 2
    reduce_bytes = ring * 4 * psi * (m if per_micro else 1)
    gather_bytes = dp_bytes - reduce_bytes
    reduce = _ring_time(reduce_bytes, buckets * (m if per_micro else 1), link, n,
                        "reduce_scatter")
    gather = _ring_time(gather_bytes, buckets * (2 * m if zero == 3 else 1), link, n,
                        "all_gather")
    if zero in (1, 2):
        exposed = max(0.0, reduce - t_b) if zero == 1 else m * max(0.0, reduce / m - t_b)
        window = t_f if cfg.parallel.overlap_param_gather else 0.0
        return exposed + max(0.0, gather - window)
    if not cfg.parallel.reshard_after_forward:  # one gather per step, before the first forward
        return max(0.0, gather - t_f) + m * max(0.0, reduce / m - t_b)
    g = gather / (2 * m)  # per micro-batch: the forward's gathers, then the backward's
    return m * (max(0.0, g - t_f) + max(0.0, g + reduce / m - t_b))


def _stage_terms(cfg: Config, layout: Layout, stage, profile: DeviceProfile,
                 links: Dict[str, GroupLink], k: int, chunks: List[range],
                 flops: Dict[str, float]) -> Dict[str, float]:
    t, lay = cfg.train, layout
    rate, m = profile.rate(lay.precision), lay.micro_batches(t.global_batch_size)
    e = 4 if lay.precision == "fp32" else 2
    tokens, tp, v = t.micro_batch_size * t.seq_len, lay.tp_size, lay.virtual_stages
    f_model = flops["model"] * tokens / tp / rate  # one micro-batch's forward
    f_re = flops["recompute"] * tokens / tp / rate
    blocks = sum(len(b) for b in chunks)
    rerun = sum(recomputed_layers(cfg, len(b)) for b in chunks)
    block_pass = profile.block_fixed_s + profile.block_per_token_s * tokens / tp
    t_f = f_model + blocks * block_pass / 3
    t_b = 2 * f_model + f_re + (2 * blocks + rerun) * block_pass / 3
    place = lay.placement
    first = any(place.holds_first(k, c) for c in range(v))
    last = any(place.holds_last(k, c) for c in range(v))
    terms = dict.fromkeys(TERMS, 0.0)
    terms["compute"], terms["recompute"] = m * 3 * f_model, m * f_re
    terms["non_matmul"] = m * (blocks + rerun / 3) * block_pass
    if tp > 1:  # all-reduces; with SP all-gathers and reduce-scatters, 6 : 4 a block
        wire, count = stage.comm["tp"], m * _tp_collectives(cfg, lay, chunks, first, last)
        terms["tp"] = _ring_time(wire, count, links["tp"], tp) if not lay.sequence_parallel \
            else 0.6 * _ring_time(wire, count, links["tp"], tp, "all_gather") \
            + 0.4 * _ring_time(wire, count, links["tp"], tp, "reduce_scatter")
    if cfg.offload.activations and profile.host_link_gbps:
        act = layer_activation_bytes(t.seq_len, t.micro_batch_size, cfg.model.n_embd,
                                     cfg.model.n_head, tp, lay.sequence_parallel, e,
                                     cfg.model.resid_pdrop > 0)
        copy = sum(offloaded_layers(cfg, len(b)) for b in chunks) * act \
            / (profile.host_link_gbps * 1e9)
        terms["offload"] = m * (max(0.0, copy - t_f) + max(0.0, copy - t_b))
    if lay.pp_size > 1:
        scatter = tp if tp > 1 and not lay.sequence_parallel else 1
        x = _ring_time(e * lay.activation_seq_len(t.seq_len) * t.micro_batch_size
                       * cfg.model.n_embd / scatter, 1, links["pp"], 2, "send_recv")
        terms["pp"] = 2 * (lay.pp_size * v - 1) * x + 2 * m * v * max(0.0, x - t_f / v)
    units = sum(len(b) for b in chunks) + 2 * first + 2 * last  # ZeRO-3's gathered units
    terms["dp"] = _dp_exposed(cfg, lay, stage.comm["dp"], stage.params, e, m, t_f, t_b,
                              links["dp"], units)
    if stage.comm["embedding"]:
        terms["embedding"] = _ring_time(stage.comm["embedding"], 1, links["embedding"], 2)
    owned = stage.params / (lay.dp_size if lay.shards_optimizer else 1)
    host = cfg.offload.optimizer * owned
    adam = 28 + (e if e < 4 else 0)  # bytes per element: AdamW reads and writes
    if profile.hbm_gbps:
        terms["optimizer"] = adam * (owned - host) / (profile.hbm_gbps * 1e9)
    if host and profile.host_link_gbps and profile.host_memory_gbps:
        link = profile.host_link_gbps * 1e9
        copies = m if lay.shards_gradients else 1
        terms["offload_optimizer"] = copies * max(0.0, 4 * host / link - t_b) + max(
            adam * host / (profile.host_memory_gbps * 1e9), e * host / link)
    return terms


def predict(cfg: Config, layout: Layout, stages: Sequence, profile: DeviceProfile,
            gpus_per_node: int) -> Prediction:
    """The predicted step of `layout` on `profile`; `stages`: per pipeline stage its
    parameters per rank and wire bytes per group (`Plan.stages`, or
    `megalite.plan.traffic.stage_traffic`)."""
    links = group_links(layout, profile, gpus_per_node)
    flops = stage_forward_flops(cfg, layout)
    chunks = layout.stage_blocks()
    stages = [_stage_terms(cfg, layout, stages[k], profile, links, k, chunks[k], flops[k])
              for k in range(layout.pp_size)]
    m = layout.micro_batches(cfg.train.global_batch_size)
    beta = expected_bubble(layout.pp_size, m, layout.virtual_stages, cfg.parallel.schedule)
    busy = [s["compute"] + s["recompute"] + s["non_matmul"] + s["tp"] + s["offload"]
            for s in stages]
    for s, b in zip(stages, busy):
        s["bubble"] = max(busy) / (1 - beta) - b
    totals = [sum(s.values()) for s in stages]
    k = max(range(len(stages)), key=totals.__getitem__)
    step, terms = totals[k], stages[k]
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    world = layout.world_size
    model_tflops = tokens / step * flops_per_token(cfg.model, cfg.train.seq_len) / world / 1e12
    recompute_per_token = sum(f["recompute"] for f in flops)
    hardware = model_tflops + tokens / step * recompute_per_token / world / 1e12
    return Prediction(step_s=step, terms=terms, critical_stage=k,
                      critical_term=max(terms, key=terms.__getitem__),
                      tokens_per_s=tokens / step, model_tflops_per_device=model_tflops,
                      hardware_tflops_per_device=hardware,
                      mfu=model_tflops / profile.peak_tflops_bf16
                      if profile.peak_tflops_bf16 else None, device=profile.name,
                      stage_terms=stages)
