"""A pipeline stage's parameters, activation bytes and wire bytes, summed chunk by chunk:
the terms the memory plan (`megalite.plan.memory`, whose docstring has the formulas) and the
planner's traffic (`megalite.plan.traffic`) share."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megalite.model.activation_offload import offloaded_blocks
from megalite.model.moe.experts import capacity
from megalite.plan import cp_terms
from megalite.plan.dims import BlockTerms, Dims, loss_bytes, offloaded_layers, recomputed_layers, ring
from megalite.plan.fp8_terms import amax_reductions
from megalite.plan.zero3_gathers import unit_gathers


@dataclass
class StageSums:
    """What a stage's chunks add up to."""

    psi: int = 0  # parameter elements
    expert_psi: int = 0  # of which routed experts split over EP (reduced and sharded over EDP)
    replicated: int = 0  # of which TP-replicated (norms, row-parallel biases, wpe)
    shared_slots: int = 0  # the TP-shared slices' gradient-sum buffer (`ParamSums`)
    largest_unit: int = 0  # ZeRO-3's largest gathered unit
    # per chunk, its ZeRO-3 units in forward order (`megalite.parallel.zero3`): (dense
    # elements, EP-split expert elements, reported by a W under a zero-bubble schedule), None
    # for a head that is the stage's own token embedding (one unit with it)
    units: List[List[Optional[Tuple[int, int, bool]]]] = field(default_factory=list)
    sends: float = 0.0  # point-to-point tensors per micro-batch
    tp_per_micro: float = 0.0  # TP wire bytes per micro-batch
    cp_per_micro: float = 0.0  # CP wire bytes per micro-batch
    chunk_act: List[float] = field(default_factory=list)  # activation bytes per chunk
    chunk_host: List[float] = field(default_factory=list)  # of which offloaded to host
    # per chunk: the working bytes at the end of its forward and at the start of its
    # backward beyond the saved ones (the loss's chunk, the gradient of the logits; the
    # received gradient), and what its backward frees before the parameters' gradients
    # arrive (the loss's saved bytes)
    chunk_forward_work: List[float] = field(default_factory=list)
    chunk_backward_work: List[float] = field(default_factory=list)
    chunk_freed: List[float] = field(default_factory=list)
    chunk_rerun: List[float] = field(default_factory=list)  # a recomputed layer's full set
    chunk_weight_grads: List[int] = field(default_factory=list)  # a W's gradient elements
    # per chunk, each block's device activation bytes, in backward order (the last first)
    chunk_blocks: List[List[float]] = field(default_factory=list)
    block_backward: float = 0.0  # the largest block backward's bytes beyond its saved set
    ledger_elements: int = 0  # fp64 routing figures summed over TP (SP) and DP x CP a step
    blocks: int = 0  # transformer blocks
    moe_layers: int = 0  # of which with an MoE layer
    moe_reruns: int = 0  # of which recomputed (their forward's exchange run again)
    decayed: int = 0  # parameter elements with weight decay (matrices, embeddings)
    largest_param: int = 0  # elements of the largest parameter
    tied_head: int = 0  # elements of a head that is this stage's own embedding (pp = 1, zb-v)


def add_chunk(sums: StageSums, d: Dims, first: bool, last: bool, n: int,
               head_copy: Optional[bool] = None, blocks: Optional[range] = None) -> None:
    """One chunk of n blocks (`blocks`: which, where known: each block's own terms, else the
    typical block's); `first` / `last`: it holds the embeddings / the head (`head_copy`: a
    parameter of its own, by default when not `first`; `plan_chunks`)."""
    head_copy = last and not first if head_copy is None else head_copy
    if blocks is None or len(d.kinds) == 1:  # every block alike
        terms = [d.kinds[True in d.kinds]] * n
        groups = [(terms[0], n)] if n else []
    else:
        terms = [d.of(i) for i in blocks]
        groups = [(kind, sum(t is kind for t in terms)) for kind in d.kinds.values()]
    moe_here = sum(c for t, c in groups if t.moe)
    sums.moe_layers += moe_here
    recomputed = recomputed_layers(d.cfg, n)
    sums.moe_reruns += sum(b.moe for b in terms[:recomputed]) if moe_here else 0
    _add_params(sums, d, first, last, groups, head_copy)
    _add_activations(sums, d, first, last, terms, recomputed)
    sums.block_backward = max(sums.block_backward, *(t.backward for t, c in groups if c), 0.0)
    if moe_here and d.layout.ep_size > 1:  # an MoE layer's exchange in the forward
        sums.chunk_forward_work[-1] = max(sums.chunk_forward_work[-1],
                                          dispatch_working_bytes(d))
    _add_traffic(sums, d, first, last, terms, recomputed)
    if moe_here:  # the step's routing figures summed over TP (SP) once per chunk
        sums.ledger_elements += moe_here * (d.cfg.model.moe.num_experts + 4) + 2
    sums.sends += (0 if last else 1) + (0 if first else 1)
    sums.units.append(_chunk_units(d, first, last, terms, head_copy))


def _chunk_units(d: Dims, first: bool, last: bool, terms: List[BlockTerms], head_copy: bool
                 ) -> List[Optional[Tuple[int, int, bool]]]:
    """A chunk's `sharding_units()` (`StageSums.units`): the embeddings (each parameter its
    own unit, the token embedding's weight gradient in a W), each block, the final norm (its
    gradient in the B), the LM head."""
    out: List[Optional[Tuple[int, int, bool]]] = \
        [(size, 0, j == 0) for j, size in enumerate(d.embeddings.units)] if first else []
    out += [(t.params.numel - t.params.expert, t.params.expert, True) for t in terms]
    if last:
        out.append((d.final_norm.numel, 0, False))
        out.append((d.vocab // d.layout.tp_size * d.cfg.model.n_embd, 0, True)
                   if head_copy else None)
    return out


def _add_params(sums: StageSums, d: Dims, first: bool, last: bool,
                groups: List[Tuple[BlockTerms, int]], head_copy: bool) -> None:
    """The chunk's parameters (`groups`: each kind of its blocks and how many): counts, the
    replicated and decayed ones, the largest."""
    h, vocab_rows = d.cfg.model.n_embd, d.vocab // d.layout.tp_size
    head = vocab_rows * h if last and head_copy else 0  # the head's own parameter
    blocks = [(t.params, c) for t, c in groups if c]
    sums.psi += sum(p.numel * c for p, c in blocks)
    sums.expert_psi += sum(p.expert * c for p, c in blocks)
    sums.blocks += sum(c for _, c in blocks)
    sums.replicated += sum(p.replicated * c for p, c in blocks)  # norms, row-parallel biases
    sums.shared_slots += sum(p.shared_slots * c for p, c in blocks)  # KV heads shared by TP
    sums.decayed += sum(p.decayed * c for p, c in blocks)
    # zero-bubble schedules: a W computes the weight gradients of the chunk's matmuls (its
    # blocks' TP-split parameters, the token embedding, the head)
    sums.chunk_weight_grads.append(sum(p.split * c for p, c in blocks)
                                   + (d.embeddings.split if first else 0) + head)
    sums.largest_param = max(sums.largest_param, *(p.largest for p, _ in blocks),
                             vocab_rows * h if first or last else 0)
    if first:
        sums.psi += d.embeddings.numel
        sums.replicated += d.embeddings.replicated
        sums.decayed += d.embeddings.decayed
    if last:
        sums.psi += d.final_norm.numel + head
        sums.replicated += d.final_norm.replicated
        sums.decayed += head
        sums.tied_head = 0 if head_copy else vocab_rows * h
    sums.largest_unit = max(sums.largest_unit, *(p.numel for p, _ in blocks),
                            vocab_rows * h if (first or last) else 0)


def _add_activations(sums: StageSums, d: Dims, first: bool, last: bool,
                     terms: List[BlockTerms], recomputed: int) -> None:
    """The chunk's saved activations (device and host), its blocks' in backward order, and
    the working bytes of its forward's end and its backward's start."""
    m, b, e, n = d.cfg.model, d.cfg.train.micro_batch_size, d.e, len(terms)
    tokens, residual = d.s_rank * b, e * d.s_local * b * m.n_embd  # a block's input
    act = recomputed * residual + (sum(t.act for t in terms[recomputed:])
                                   if len(d.kinds) > 1 else (n - recomputed) * d.layer_act_full)
    # a recomputed layer's full set exists only while it is re-run, in the backward
    sums.chunk_rerun.append(max((t.act for t in terms[:recomputed]), default=0.0))
    if first:
        act += 8 * tokens + (residual if m.embd_pdrop > 0 else 0)
    loss = loss_bytes(tokens, d.vocab // d.layout.tp_size, e, d.layout.tp_size) \
        if last else None
    if last:  # ln_f's input and output, its statistics, what the loss saves
        act += 2 * residual + 8 * d.s_local * b + loss["saved"]
    attention = cp_terms.working_bytes(d.cfg, d.layout, e)["forward"] if n else 0.0
    sums.chunk_forward_work.append(max(loss["forward"] if last else 0.0, attention))
    sums.chunk_backward_work.append(loss["backward"] if last else residual)
    sums.chunk_freed.append(loss["saved"] if last else 0.0)
    on_host = offloaded_blocks(n, recomputed, d.cfg.offload.activations_layers) \
        if offloaded_layers(d.cfg, n) else range(0)
    host = sum(terms[i].act for i in on_host)
    sums.chunk_blocks.append([residual if i < recomputed else 0.0 if i in on_host
                              else terms[i].act for i in reversed(range(n))])
    if on_host and not recomputed and not first:
        # the first block's input, copied to host, stays on the device too: the schedule
        # holds the received activation for its gradient
        act += residual
    sums.chunk_act.append(act - host)
    sums.chunk_host.append(host)


def moe_tp_bytes(d: Dims, rerun: bool = False) -> float:
    """An MoE layer's TP wire bytes per micro-batch under SP (`megalite.model.moe.layer`;
    full = e·s'·b·h with s' = s/cp, T = s'·b tokens gathered, r = (tp − 1)/tp): TP-split
    experts gather the tokens (backward: reduce-scatter) and reduce-scatter the outputs
    (backward: all-gather), 4·r·full, and gather the int64 choices (8·T·k) and the fp32
    weights (4·T·k, backward reduce-scattered), 16·r·T·k. EP folded over TP: the routed
    experts take the rank's own tokens over EP; TP gathers only the choices, 8·r·T·k, and
    the shared experts' input and output as the TP-split experts' tokens, 4·r·full.
    `rerun`: a recomputed layer's forward again (torch checkpoint's early stop ends it once
    its saved tensors are back: the TP-split experts' output reduce-scatter is not repeated;
    the folded layer's shared experts and gathered choices come last and are)."""
    lay, moe = d.layout, d.cfg.model.moe
    r, full, tk = ring(lay.tp_size), d.full, d.s_rank * d.cfg.train.micro_batch_size * moe.top_k
    if lay.ep_size > 1:  # folded (EP with tp > 1 needs SP)
        shared = (2 if rerun else 4) * r * full if moe.shared_experts else 0.0
        return shared + 8 * r * tk
    return r * full + 12 * r * tk if rerun else 4 * r * full + 16 * r * tk


def _add_traffic(sums: StageSums, d: Dims, first: bool, last: bool,
                 terms: List[BlockTerms], recomputed: int) -> None:
    """The chunk's TP and CP wire bytes per micro-batch."""
    n = len(terms)
    sums.cp_per_micro += cp_terms.wire_bytes(d.cfg, d.layout, d.e, n, recomputed)
    tp, sp = d.layout.tp_size, d.layout.sequence_parallel
    if tp == 1:
        return
    r, full = ring(tp), d.full
    # recompute's re-run stops once the saved tensors are rebuilt (torch
    # checkpoint's early stop): the MLP output's reduction is not repeated
    per_layer, rerun = (10 * r * full, 3 * r * full) if sp else \
        (4 * 2 * r * full, 2 * r * full)
    sums.tp_per_micro += n * per_layer + recomputed * rerun
    # an MoE layer's own collectives in place of the dense MLP's (SP: its forward's all-gather
    # and reduce-scatter, the backward's two and the re-gather, 5·r·full; a re-run 1·r·full)
    moe = sum(t.moe for t in terms) if d.cfg.model.moe.enabled else 0
    moe_rerun = sum(t.moe for t in terms[:recomputed]) if moe else 0
    if moe and sp:
        sums.tp_per_micro += moe * (moe_tp_bytes(d) - 5 * r * full) \
            + moe_rerun * (moe_tp_bytes(d, rerun=True) - r * full)
    # fp8.recipe: the amax all-reduces (fp32) of each block and re-run
    sums.tp_per_micro += 2 * r * 4 * (n * amax_reductions(d.cfg, tp)[1]
                                      + recomputed * amax_reductions(d.cfg, tp, True)[1])
    if first:
        sums.tp_per_micro += 2 * r * full  # embedding: all-reduce, or RS + all-gather
    if last:  # head, loss
        sums.tp_per_micro += (3 if sp else 2) * r * full \
            + 2 * r * 12 * d.s_rank * d.cfg.train.micro_batch_size


def stage_comm(d: Dims, sums: StageSums, tied: bool, stage: int) -> Dict[str, float]:
    """Wire bytes per step per group of one rank of pipeline stage `stage` (dp: the gradient
    reductions and ZeRO's gathers, over the DP x CP ranks that hold the same parameters)."""
    lay, t, e, psi = d.layout, d.cfg.train, d.e, sums.psi
    gathered = zero3_gathered(d, sums, stage) if lay.zero_stage == 3 else (0, 0, 0)
    tp, pp, dp, micro = lay.tp_size, lay.pp_size, lay.grad_replicas, d.micro
    r, rd = ring(tp), ring(dp)
    shard = dp if lay.shards_optimizer else 1
    # with TP and no SP each TP rank sends 1/tp of a transfer and the receiver all-gathers
    scatter = tp if tp > 1 and not lay.sequence_parallel and pp > 1 else 1
    tp_bytes = micro * sums.tp_per_micro + (
        2 * r * 4 * sums.replicated / shard if lay.sequence_parallel else 0) + (
        2 * r * 4 * sums.shared_slots / shard) + (
        micro * sums.sends * r * d.full if scatter > 1 else 0) if tp > 1 else 0.0
    pp_bytes = float(micro * sums.sends * e * d.s_local * t.micro_batch_size
                     * d.cfg.model.n_embd) / scatter if pp > 1 else 0.0
    dp_bytes = _reduction_bytes(lay.zero_stage, rd, psi - sums.expert_psi, e, micro,
                                gathered[0]) if dp > 1 else 0.0
    emb_bytes = 4 * (d.vocab // tp * d.cfg.model.n_embd) / shard if tied else 0.0
    out = {"tp": tp_bytes, "cp": micro * sums.cp_per_micro, "pp": pp_bytes, "dp": dp_bytes,
           "embedding": emb_bytes}
    for group, size in routing_figure_groups(d, sums):
        out[group] += routing_figure_bytes(d, sums, group, size)
    if lay.ep_size > 1:  # the experts' reductions over EDP (the ZeRO table), the token exchange;
        edp = lay.expert_grad_replicas  # each + the grad norm's fp64 sum of expert squares
        out["edp"] = _reduction_bytes(lay.zero_stage, ring(edp), sums.expert_psi, e, micro,
                                      gathered[1]) + (16 * ring(edp) if lay.shards_optimizer
                                                      else 0.0) if edp > 1 else 0.0
        out["ep"] = micro * (sums.moe_layers * dispatch_bytes(d)
                             + sums.moe_reruns * dispatch_bytes(d, rerun=True)) \
            + 16 * ring(lay.ep_size)
    return out


def routing_figure_groups(d: Dims, sums: StageSums) -> List[Tuple[str, int]]:
    """The groups a step's MoE routing figures are summed over (`megalite.model.moe.step`):
    a stage with MoE layers over TP (SP: each TP rank recorded its own tokens) and DP x CP;
    every stage of a model with MoE layers over PP (each layer's figures gathered)."""
    lay, out = d.layout, []
    if sums.ledger_elements:
        out += [("tp", lay.tp_size)] if lay.sequence_parallel and lay.tp_size > 1 else []
        out += [("dp", lay.grad_replicas)] if lay.grad_replicas > 1 else []
    if lay.pp_size > 1 and d.cfg.model.moe.enabled:
        out.append(("pp", lay.pp_size))
    return out


def routing_figure_bytes(d: Dims, sums: StageSums, group: str, size: int) -> float:
    """One step's all-reduce of the routing figures over `group` (fp64, `size` ranks, 2·r·8
    bytes an element): a stage's per chunk, L layers' E counts, aux, z, dropped and assigned
    + the pooled value and the forwards (`StageSums.ledger_elements`); over PP the model's
    L MoE layers × 6 figures (4 without a router bias)."""
    moe = d.cfg.model.moe
    if group == "pp":
        layers = sum(moe.is_moe_layer(i) for i in range(d.cfg.model.n_layer))
        return 2 * ring(size) * 8 * layers * (6 if moe.has_bias else 4)
    return 2 * ring(size) * 8 * sums.ledger_elements


def _reduction_bytes(zero: int, rd: float, psi: float, e: int, micro: int, gathered: int
                     ) -> float:
    """The gradient reductions' and ZeRO's gathers' wire bytes of `psi` elements over a
    group whose ring factor is `rd` (the ZeRO table, `megalite.plan.zero_table`); zero 3's
    gathers: `gathered` elements a step (`zero3_gathered`)."""
    return {0: 2 * rd * 4 * psi,
            1: rd * (4 + e) * psi,
            2: rd * (micro * 4 + e) * psi,
            3: rd * (micro * 4 * psi + e * gathered)}[zero]


def zero3_gathered(d: Dims, sums: StageSums, stage: int) -> Tuple[int, int, int]:
    """The parameter elements ZeRO-3 all-gathers in one step on `stage` (dense, EP-split
    experts: each unit's elements times its gathers in the schedule's walk,
    `megalite.plan.zero3_gathers`) and its all-gathers (units) a step."""
    lay = d.layout
    chains, sizes = [], []
    for chunk in sums.units:  # the head of a stage holding the token embedding is its unit:
        chain = []  # the stage's first (its chunk 0 starts with the embeddings)
        for unit in chunk:
            chain.append((0, True) if unit is None else (len(sizes), unit[2]))
            sizes += [] if unit is None else [unit]
        chains.append(tuple(chain))
    schedule = d.cfg.parallel.schedule if lay.pp_size > 1 else "auto"
    counts = unit_gathers(lay.pp_size, stage, d.micro, lay.virtual_stages, schedule,
                          tuple(chains), d.cfg.parallel.reshard_after_forward)
    return (sum(n * dense for n, (dense, _, _) in zip(counts, sizes)),
            sum(n * expert for n, (_, expert, _) in zip(counts, sizes)), sum(counts))


def kept_rows(moe, tokens: int) -> int:
    """The assignments a rank's `tokens` keep under balanced routing: T·k (dropless), with a
    capacity C an expert min(T·k, E·C) (`megalite.model.moe.experts.capacity`)."""
    cap = capacity(moe, tokens)
    return tokens * moe.top_k if cap is None else min(tokens * moe.top_k, moe.num_experts * cap)


def dispatch_working_bytes(d: Dims) -> float:
    """What an MoE layer's exchange under EP holds at once beyond the saved tensors (which
    are the serial layer's: the expert-major rows, their products and outputs), forward or
    backward, on one rank (T its tokens, N the rows it sends, balanced routing):

      alltoall   the rows sent beside those received, 2·e·N·h (the dispatch, then the
                 outputs' return; the gradients' alike in the backward)
      allgather  the ep·T gathered tokens and the combined outputs before their
                 reduce-scatter, 2·e·ep·T·h, + the gathered choices and weights 12·ep·T·k"""
    lay, m = d.layout, d.cfg.model
    ep, moe, tokens = lay.ep_size, m.moe, d.s_local * d.cfg.train.micro_batch_size
    if d.cfg.parallel.ep_dispatch == "allgather":
        return ep * tokens * (2 * d.e * m.n_embd + 12 * moe.top_k)
    return 2 * d.e * kept_rows(moe, tokens) * m.n_embd


def dispatch_bytes(d: Dims, rerun: bool = False) -> float:
    """One MoE layer's token exchange over EP per micro-batch, forward and backward, wire
    bytes of one rank (`megalite.model.moe.dispatcher`; T tokens of the rank, k choices,
    h wide, e-byte rows, fp32 routing weights, int64 counts and choices; r = (ep−1)/ep):

      alltoall   counts 8·E·r, then the rows out and back in the forward and again in the
                 backward, 4·N·h·e·r — with balanced routing (a rank keeps 1/ep of its
                 rows); skewed routing moves more or less. N = T·k kept assignments
                 (dropless), with model.moe.capacity_factor min(T·k, E·C), C the capacity
                 of an expert per rank (`megalite.model.moe.experts.capacity`): exact
                 whenever every expert is chosen at least C times on every rank
      allgather  the choices 8·T·k, tokens e·T·h and weights 4·T·k gathered, the outputs
                 reduce-scattered (e·T·h); backward the tokens' and weights' gradients
                 reduce-scattered, the outputs' all-gathered: r·ep·T·(3e·h + e·h + 8k + 8k)

    `rerun`: a recomputed layer's forward exchange again (alltoall 8·E·r + 2·N·h·e·r,
    allgather r·ep·T·(2e·h + 12k))."""
    lay, m = d.layout, d.cfg.model
    ep, moe = lay.ep_size, m.moe
    # a rank routes its own tokens: s/cp positions, /tp with SP (EP folded over TP: each
    # rank dispatches its own sequence-parallel tokens)
    r, tokens = ring(ep), d.s_local * d.cfg.train.micro_batch_size
    if d.cfg.parallel.ep_dispatch == "allgather":
        return r * ep * tokens * ((2 if rerun else 4) * d.e * m.n_embd
                                  + (12 if rerun else 16) * moe.top_k)
    return r * (8 * moe.num_experts
                + (2 if rerun else 4) * kept_rows(moe, tokens) * m.n_embd * d.e)
