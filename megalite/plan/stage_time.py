"""One pipeline stage's terms of the predicted step, per rank and step: compute, recompute,
non_matmul, head_loss, grad_accumulate, offload, optimizer and offload_optimizer here, the
communication terms from `megalite.plan.comm_time` and `megalite.plan.expert_time`
(`stage_seconds`); the per-stage FLOPs and the optimizer step's rates the search bounds use.
The formulas, term by term: `megalite.plan.time_model`'s docstring.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.model.families import family
from megalite.plan.comm_time import StagePass, comm_terms
from megalite.plan.devices import DeviceProfile, fits_dropout
from megalite.plan.dims import recomputed_layers
from megalite.plan.document_terms import attention_forward_s
from megalite.plan.expert_time import expert_links, expert_terms
from megalite.plan.fp8_terms import cast_traffic_bytes
from megalite.plan.links import GroupLink
from megalite.plan.offload import HOST_ADAM_BYTES, activation_offload_s, optimizer_offload_term
from megalite.plan.traffic_bytes import (
    LOSS_BYTES_PER_LOGIT,
    OPTIMIZER_BYTES,
    dropout_bytes,
    dropout_on,
    loss_elements,
)

TERMS = ("compute", "recompute", "non_matmul", "head_loss", "grad_accumulate", "tp", "cp",
         "offload", "ep", "expert_imbalance", "bubble", "pp", "dp", "edp", "embedding",
         "optimizer", "offload_optimizer")


def stage_forward_flops(cfg: Config, layout: Layout) -> List[Dict[str, float]]:
    """Per stage, forward FLOPs per token of the whole (untensor-split) stage: `model` and
    the `recompute` re-run; `fp8`, `fp8_recompute`: of which the FP8 linears' (fp8.recipe)."""
    m, s = cfg.model, cfg.train.seq_len
    fam = family(m)
    kinds = {}  # each block its own active parameters (an MoE model's dense blocks)

    def block(i: int) -> float:
        key = fam.mixture_of_experts and m.moe.is_moe_layer(i)
        if key not in kinds:
            kinds[key] = 2 * fam.block_parameters_of(m, i) + 4 * m.n_embd * s
        return kinds[key]
    linears = 2 * fam.fp8_linear_parameters(m) if cfg.fp8.recipe != "none" else 0
    place = layout.placement
    out = []
    for k, chunks in enumerate(layout.stage_blocks()):
        model = recompute = fp8 = fp8_recompute = 0.0
        for c, blocks in enumerate(chunks):
            rerun = recomputed_layers(cfg, len(blocks))
            model += sum(block(i) for i in blocks)
            recompute += sum(block(i) for i in list(blocks)[:rerun])
            fp8 += len(blocks) * linears
            fp8_recompute += rerun * linears
            if place.holds_last(k, c):
                model += fam.head_forward_flops_per_token(m)
        out.append({"model": model, "recompute": recompute, "fp8": fp8,
                    "fp8_recompute": fp8_recompute})
    return out


def matmul_seconds(flops: float, fp8_flops: float, profile: DeviceProfile, precision: str
                   ) -> float:
    """Seconds of `flops` matmul FLOPs of which `fp8_flops` run in FP8: those at the profile's
    fp8 rate where it has one (else, as on a CPU's emulation, at the precision's rate)."""
    rate = profile.rate(precision)
    fp8_rate = profile.rate("fp8") if fp8_flops and "fp8" in profile.matmul_tflops else rate
    return (flops - fp8_flops) / rate + fp8_flops / fp8_rate


def _dropout_pass_s(cfg: Config, layout: Layout, profile: DeviceProfile, tokens: int,
                    e: int) -> float:
    """Seconds a block pass gains (or, negative, loses) against the measured block's because
    the run's residual dropout is on where the measurement's was off (or the reverse)."""
    measured = fits_dropout(profile.block_fits)
    if measured is None or not profile.hbm_gbps or (measured > 0) == dropout_on(cfg):
        return 0.0
    per_site = tokens * cfg.model.n_embd / (layout.tp_size if layout.sequence_parallel else 1)
    sign = 1 if dropout_on(cfg) else -1
    return sign * 2 * per_site * dropout_bytes(e) / (profile.hbm_gbps * 1e9)


def host_step_s_per_param(profile: DeviceProfile, e: int, ranks_per_node: int
                          ) -> Optional[float]:
    """Seconds of offload.optimizer's host step per offloaded parameter on one of
    `ranks_per_node` ranks: the fused AdamW and the cast to the model dtype (4 + e bytes at
    AdamW's memory rate); None where the profile does not price it."""
    rate = profile.host_adam_per_rank(ranks_per_node)
    return None if not rate else (HOST_ADAM_BYTES + 4 + e) / HOST_ADAM_BYTES / rate


def device_step_s_per_param(profile: DeviceProfile, e: int) -> Optional[float]:
    """Seconds of the device's optimizer step per owned parameter (zeroing aside)."""
    if not profile.hbm_gbps:
        return None
    return (OPTIMIZER_BYTES + (4 + e if e < 4 else 0)) / (profile.hbm_gbps * 1e9)


def stage_seconds(cfg: Config, layout: Layout, stage, profile: DeviceProfile,
                 links: Dict[str, GroupLink], k: int, chunks: List[range],
                 flops: Dict[str, float], ranks_per_node: int, loss: str,
                 mask_factor: float = 1.0) -> Tuple[Dict[str, float], StagePass]:
    """Stage k's terms a step (`megalite.plan.time_model`'s docstring; bubble, pp and dp:
    `megalite.plan.time_model.predict`) and what its
    communication is timed against; `mask_factor`: the masked attention's time over the dense
    causal attention's (1: causal)."""
    t, lay = cfg.train, layout
    m = lay.micro_batches(t.global_batch_size)
    e = 4 if lay.precision == "fp32" else 2
    tokens, tp = t.micro_batch_size * t.seq_len // lay.cp_size, lay.tp_size  # the rank's
    f_model = matmul_seconds(flops["model"], flops["fp8"], profile, lay.precision) \
        * tokens / tp  # one micro-batch's forward
    f_re = matmul_seconds(flops["recompute"], flops["fp8_recompute"], profile,
                          lay.precision) * tokens / tp
    blocks = sum(len(b) for b in chunks)
    rerun = sum(recomputed_layers(cfg, len(b)) for b in chunks)
    # what the document mask changes in a block's forward (its attention × factor − 1)
    masked = (mask_factor - 1) * attention_forward_s(cfg, lay, profile, 1)
    f_model += blocks * masked
    f_re += rerun * masked
    place = lay.placement
    first = any(place.holds_first(k, c) for c in range(lay.virtual_stages))
    last = any(place.holds_last(k, c) for c in range(lay.virtual_stages))
    block_pass, embed, loss_f, loss_b, accumulate = _memory_bound_s(
        cfg, lay, stage, profile, tokens, e, first, last, loss)
    t_f = f_model + blocks * block_pass / 3 + embed / 3 + loss_f
    t_b = 2 * f_model + f_re + (2 * blocks + rerun) * block_pass / 3 + 2 * embed / 3 \
        + loss_b + accumulate
    terms = dict.fromkeys(TERMS, 0.0)
    terms["compute"], terms["recompute"] = m * 3 * f_model, m * f_re
    terms["non_matmul"] = m * ((blocks + rerun / 3) * block_pass + embed)
    terms["head_loss"] = m * (loss_f + loss_b)
    terms["grad_accumulate"] = m * accumulate
    if cfg.offload.activations and profile.h2d_gbps and profile.d2h_gbps:
        terms["offload"] = m * _activation_offload(cfg, lay, profile, k, chunks, e, flops,
                                                   block_pass, accumulate, f_model, loss_f,
                                                   loss_b, masked)
    # a zero-bubble W: the linears' and the head's weight gradients (attention has none)
    t_w = max(0.0, f_model - blocks * mask_factor * attention_forward_s(cfg, lay, profile, 1)) \
        + accumulate
    p = StagePass(m, e, blocks, rerun, first, last, t_f, t_b, profile.rate(lay.precision), t_w)
    terms.update(comm_terms(cfg, lay, stage, links, chunks, p))
    terms.update(expert_terms(cfg, lay, stage, expert_links(lay, profile, ranks_per_node),
                              profile, chunks, m, rerun, t_b))
    terms["optimizer"], terms["offload_optimizer"] = _optimizer_terms(
        cfg, lay, stage, profile, ranks_per_node, m, e, t_f, t_b, first)
    return terms, p


def _memory_bound_s(cfg: Config, lay: Layout, stage, profile: DeviceProfile, tokens: int,
                    e: int, first: bool, last: bool, loss: str
                    ) -> Tuple[float, float, float, float, float]:
    """(a block pass beyond its FLOPs, the embedding's dropout site, the loss's forward and
    backward, the gradient accumulation), seconds per micro-batch of the rank's `tokens`."""
    hbm = profile.hbm_gbps * 1e9 if profile.hbm_gbps else None
    tp = lay.tp_size
    block_pass = max(0.0, profile.block_pass_s(cfg.model.n_embd, tokens, tp)
                     + _dropout_pass_s(cfg, lay, profile, tokens, e))
    if not hbm:
        return block_pass, 0.0, 0.0, 0.0, 0.0
    embed = 0.0  # the embedding's dropout site, which no measured block holds
    if first and cfg.model.embd_pdrop > 0:
        embed = tokens * cfg.model.n_embd / (tp if lay.sequence_parallel else 1) \
            * dropout_bytes(e) / hbm
    loss_f = loss_b = 0.0
    if last:
        fwd, bwd = LOSS_BYTES_PER_LOGIT[loss]
        elements = loss_elements(cfg, lay, tokens)
        loss_f, loss_b = fwd * elements / hbm, bwd * elements / hbm
    # per micro-batch, in the backward (zero 2/3 fold the owned part over DP x CP)
    per_param = e + 8 + (4 + 12 / lay.grad_replicas if lay.shards_gradients else 0)
    # fp8.recipe's casts: a third in the forward, as a block pass
    return block_pass + cast_traffic_bytes(cfg, tp, e) / hbm, embed, loss_f, loss_b, \
        per_param * stage.params / hbm


def _activation_offload(cfg: Config, lay: Layout, profile: DeviceProfile, k: int,
                        chunks: List[range], e: int, flops: Dict[str, float],
                        block_pass: float, accumulate: float, f_model: float,
                        loss_f: float, loss_b: float, masked: float) -> float:
    """Activation offload's seconds a micro-batch from a block's and the head's times;
    `masked`: what the document mask changes in a block's forward (its attention's time,
    the same factor as the compute term's)."""
    tokens, tp = cfg.train.micro_batch_size * cfg.train.seq_len // lay.cp_size, lay.tp_size
    blocks = sum(len(b) for b in chunks)
    fp8_block = flops["fp8"] / blocks if blocks else 0.0  # one block's FP8 linears
    block_flops = 2 * family(cfg.model).block_parameters(cfg.model) \
        + 4 * cfg.model.n_embd * cfg.train.seq_len
    matmuls = matmul_seconds(block_flops, fp8_block, profile, lay.precision) * tokens / tp \
        + masked
    block = (matmuls + block_pass / 3,
             2 * matmuls + 2 * block_pass / 3 + accumulate / max(1, blocks))
    head = max(0.0, f_model - blocks * matmuls)  # the head's forward: 3x with backward
    return activation_offload_s(cfg, lay, profile, k, chunks, e, block,
                                3 * head + loss_f + loss_b)


def _optimizer_terms(cfg: Config, lay: Layout, stage, profile: DeviceProfile,
                     ranks_per_node: int, m: int, e: int, t_f: float, t_b: float,
                     first: bool) -> Tuple[float, float]:
    """(the device's optimizer step and zeroing, optimizer offload's exposed time)."""
    hbm = profile.hbm_gbps * 1e9 if profile.hbm_gbps else None
    owned = stage.params / (lay.grad_replicas if lay.shards_optimizer else 1)
    host = cfg.offload.optimizer * owned
    optimizer = offloaded = 0.0
    if hbm:
        zeroed = stage.params if not lay.shards_gradients else owned - host
        optimizer = (device_step_s_per_param(profile, e) * (owned - host) + 4 * zeroed / hbm)
    host_rate = profile.host_adam_per_rank(ranks_per_node)
    if host and host_rate and profile.h2d_gbps and profile.d2h_gbps:
        offloaded = optimizer_offload_term(cfg, lay, profile, host, host_rate, m, e, t_f, t_b,
                                           first)
    return optimizer, offloaded
