"""The layout search's lower bounds (`megalite.plan.search`): a candidate's peak memory
(`memory_lower_bound`) and step time (`time_lower_bound`; `TimeBound`, the search's, with its
rate and caches) that no plan or prediction of it is below, so the search can leave the
candidates whose bounds exceed the k-th best prediction unplanned.

Under train.attention_mask=document the time bound charges each block's attention × the
candidate's own mask factor (`mask_factor`: the one `predict` charges, which depends on the
candidate only through its cp, cp_comm and micro-batch size), so the bound stays below the
prediction whether the mask makes attention cheaper (factor < 1) or dearer (a calibrated
ratio > 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

from megalite.config.layout import Layout
from megalite.config.schedule_rules import ZERO_BUBBLE, resolve_schedule
from megalite.config.schema import Config
from megalite.model.families import family
from megalite.model.family import local_numel
from megalite.parallel.param_spec import padded_vocab_size
from megalite.parallel.schedule import max_in_flight
from megalite.plan.devices import DeviceProfile, fits_dropout
from megalite.plan.dims import recomputed_layers, typical_block
from megalite.plan.document_terms import MaskedWork, masking
from megalite.plan.links import group_links, ring_step_s
from megalite.plan.pipeline_terms import chunk_shares
from megalite.plan.space import Choice, apply_choice, offload_fraction
from megalite.plan.stage_time import stage_forward_flops
from megalite.plan.traffic_bytes import dropout_bytes, dropout_on
from megalite.plan.zero_table import model_state_bytes


def device_kind(profile: DeviceProfile) -> Tuple[str, bool]:
    """(Layout device type, computes in bf16) of a profile."""
    return profile.device_type, "bf16" in profile.matmul_tflops


def _stage_flops(cache: dict, cfg: Config, c: Choice) -> Tuple[tuple, ...]:
    """Per stage (model, recompute) forward FLOPs per token, (blocks, recomputed blocks) and
    its chunk 0's model forward FLOPs per token, cached per (pp, v, schedule, recompute,
    recompute_layers) (zb-v's V puts both ends on stage 0)."""
    key = (c.pp, c.virtual_stages, c.schedule, c.recompute, c.recompute_layers)
    if key not in cache:
        cc = replace(cfg, pp=c.pp, parallel=replace(cfg.parallel, virtual_stages=c.virtual_stages),
                     train=replace(cfg.train, recompute=c.recompute,
                                   recompute_layers=c.recompute_layers))
        layout = Layout(pp_size=c.pp, virtual_stages=c.virtual_stages,
                        v_shape=c.schedule == "zb-v", n_layer=cfg.model.n_layer,
                        edge_stage_layers=cfg.parallel.edge_stage_layers)
        cache[key] = tuple(
            (f["model"], f["recompute"], sum(len(b) for b in chunk),
             sum(recomputed_layers(cc, len(b)) for b in chunk), share[0] * f["model"])
            for f, chunk, share in zip(stage_forward_flops(cc, layout), layout.stage_blocks(),
                                       chunk_shares(cc, layout)))
    return cache[key]


def _stage_runs(cache: dict, cfg: Config, c: Choice) -> Tuple[Tuple[tuple, int], ...]:
    """`_stage_flops` with each run of equal consecutive stages as one (stage, count): the
    bound's busy + wait over a run is largest at its last stage (the wait only grows)."""
    key = ("runs", c.pp, c.virtual_stages, c.schedule, c.recompute, c.recompute_layers)
    if key not in cache:
        runs: list = []
        for stage in _stage_flops(cache, cfg, c):
            if runs and runs[-1][0] == stage:
                runs[-1][1] += 1
            else:
                runs.append([stage, 1])
        cache[key] = tuple((stage, count) for stage, count in runs)
    return cache[key]


def time_lower_bound(cfg: Config, c: Choice, rate: float, cache: dict, e: int = 2,
                     tp_bus_gbps: float = float("inf"), mask_factor: float = 1.0,
                     latency: float = 0.0, buses: Optional[dict] = None,
                     block_extra: Tuple[float, float] = (0.0, 0.0)) -> float:
    """Per stage k its compute + recompute + the blocks' TP wire bytes at the TP group's bus
    bandwidth (4 all-reduces a block, with SP 6 all-gathers + 4 reduce-scatters; a
    recomputed block's re-run 1, with SP 3: the plan's count, without the embedding, the head
    and the latencies) + the latency of its blocks' TP and CP collectives (`latency`: the
    profile's smallest per ring step, TP's at least `buses["tp_latency"]`, the smallest of
    its group's link and fits; CP: all-gather and reduce-scatter a block, the ring's
    accumulator sends), for a rank's s/cp tokens, + what the schedule must leave it idle: its
    first operation waits for micro-batch 0's chunk-0 forwards on the stages before it, and
    (1F1B, interleaved: a stage's last operation is chunk 0's backward of the last
    micro-batch) its last backward is followed by theirs, at least twice a forward each; the
    largest over the stages. The simulated pipeline (`megalite.plan.pipeline_sim`) of the
    prediction, whose operations are no shorter, is no faster; with equal stages this is the
    formula's busy / (1 − bubble). `mask_factor`: the document mask's factor on each block's
    4·h·s attention FLOPs a token (forward, backward and re-run), as the prediction charges it
    (at `rate`, no slower than the precision's: still a lower bound for any factor >= 0).
    No step is shorter than ZeRO 2/3's per-micro-batch reduce-scatters either (a bucket
    each, with ZeRO-3 a block each: the latencies, and 4 bytes a dense block parameter over
    the DP x CP ring at `buses["dp"]`), which the prediction exposes where they outlast the
    backward (`megalite.plan.comm_time`: its stage's compute terms + its exposed DP are no
    less than the stream). `buses` (the bus GB/s of this layout's groups, each the one its
    collective is priced on; none: infinite) also prices CP's wire bytes, which the
    prediction charges fully exposed: under allgather each block's K/V all-gather (forward
    and re-run) and reduce-scatter (backward), under ring the backward's accumulator sends
    (`megalite.plan.cp_terms.exposed_s`; the ring's K/V sends it hides under attention).
    `block_extra`: (a block pass's seconds beyond its FLOPs, a block's gradient accumulation
    seconds) a micro-batch, no more than the prediction's non_matmul and grad_accumulate
    terms charge a block (`TimeBound.per_block`). Under ZeRO 1/2 with pp > 1 and one chunk
    a stage, stage 0's parameter gather adds what its first forward cannot hide
    (`_first_gather_s`)."""
    runs = _stage_runs(cache, cfg, c)
    m = cfg.train.global_batch_size // (c.micro_batch_size * c.dp)
    seq = cfg.train.seq_len / c.cp  # a rank's positions of a sequence
    tokens = c.micro_batch_size * seq / c.tp / rate  # seconds per FLOP a token, a micro-batch
    ring_full = (c.tp - 1) / c.tp * e * seq * c.micro_batch_size \
        * cfg.model.n_embd / (tp_bus_gbps * 1e9)
    per_block, rerun = (10, 3) if c.sp else (8, 2)
    masked = (mask_factor - 1) * 4 * cfg.model.n_embd * cfg.train.seq_len  # a block's, a token
    idle_per_stage = 1 if resolve_schedule(c.schedule, c.virtual_stages) in ZERO_BUBBLE else 3
    # each collective's latency (the ring's ranks − 1 steps at the profile's smallest)
    tp_count = ((10, 3) if c.sp else (4, 1)) if c.tp > 1 else (0, 0)
    cp_count = 0 if c.cp == 1 else 2 * (c.cp - 1) if c.cp_comm == "allgather" else c.cp
    replicas = c.dp * c.cp - 1  # ZeRO 2/3 reduce-scatter each micro-batch, one a bucket
    bus = buses or {}
    tp_latency = max(latency, bus.get("tp_latency", 0.0))  # the TP group's own, where known
    cp_wire = _cp_wire_s(cfg, c, e, bus)
    if ("dense", c.tp) not in cache:
        cache[("dense", c.tp)] = _dense_block_numel(cfg.model, c.tp)
    dense = cache[("dense", c.tp)]
    pipe, flow, before = 0.0, 0.0, 0.0
    for (f, r, n, rec, first_chunk), count in runs:
        busy = m * ((3 * f + r + (3 * n + rec) * masked) * tokens
                    + ring_full * (n * per_block + rec * rerun)
                    + tp_latency * (n * tp_count[0] + rec * tp_count[1]) * (c.tp - 1)
                    + latency * n * cp_count
                    + cp_wire[0] * (n + rec) + cp_wire[1] * n
                    + block_extra[0] * (n + rec / 3) + block_extra[1] * n)
        # the DP stream's reductions outlast no step (time_model: dp's exposure)
        streamed = m * (replicas * latency * (n if c.zero == 3 else 1)
                        + replicas / (replicas + 1) * 4 * n * dense
                        / (bus.get("dp", float("inf")) * 1e9)) if c.zero >= 2 else 0.0
        wait = idle_per_stage * first_chunk * min(1.0, mask_factor) * tokens  # a stage adds
        pipe = max(pipe, busy + before + (count - 1) * wait)  # a run's last stage: its most
        flow = max(flow, streamed)
        before += count * wait
    gather = _first_gather_s(cfg, c, e, bus, cache, runs[0][0][2], latency)
    return max(pipe + max(0.0, gather - pipe / m), flow)


def _first_gather_s(cfg: Config, c: Choice, e: int, bus: dict, cache: dict, blocks: int,
                    latency: float) -> float:
    """No more than stage 0's ZeRO 1/2 parameter all-gather a step (e bytes a dense
    parameter of its `blocks` blocks and its embeddings over the DP x CP ring at
    `bus["dp_all_gather"]`, one collective's latency), with pp > 1 and one chunk a stage; 0
    otherwise. The prediction exposes what of it outlasts stage 0's first forward
    (`megalite.plan.pipeline_sim.DpWindows.gather`; without overlap_param_gather all of
    it), which starts the step and is at most 1/m of the stage's busy time; so with P no more
    than the pipeline's makespan, stage 0's step (makespan + its exposed DP) is at least
    P + max(0, gather − P/m)."""
    n = c.dp * c.cp
    if c.pp == 1 or c.virtual_stages > 1 or c.zero not in (1, 2) or n == 1:
        return 0.0
    if ("first", c.tp, c.ep) not in cache:
        cache[("first", c.tp, c.ep)] = _rank_numel(cfg.model, c.tp, c.ep)[1]
    psi = blocks * cache[("dense", c.tp)] + cache[("first", c.tp, c.ep)]
    return (n - 1) / n * e * psi / (bus.get("dp_all_gather", float("inf")) * 1e9) \
        + (n - 1) * latency


def _cp_wire_s(cfg: Config, c: Choice, e: int, bus: dict) -> Tuple[float, float]:
    """CP's wire seconds a micro-batch (at `bus`'s GB/s, no latency) of each block's forward
    (and re-run) and of its backward, as `megalite.plan.cp_terms.exposed_s` charges them
    (exposed); (0, 0) without CP."""
    if c.cp == 1:
        return 0.0, 0.0
    mc = cfg.model
    kv = e * c.micro_batch_size * 2 * max(1, mc.kv_heads // c.tp) * mc.head_size \
        * (cfg.train.seq_len // c.cp)  # a rank's K and V (cp_terms.kv_bytes)
    if c.cp_comm == "allgather":
        return ((c.cp - 1) * kv / (bus.get("cp_all_gather", float("inf")) * 1e9),
                (c.cp - 1) * kv / (bus.get("cp_reduce_scatter", float("inf")) * 1e9))
    return 0.0, c.cp * kv * max(e, 4) / e / (bus.get("cp_send", float("inf")) * 1e9)


def _dense_block_numel(mc, tp: int) -> int:
    """A block's elements a rank holds that DP x CP reduce (all but its routed experts)."""
    return family(mc).block_numel(mc, tp) - (_expert_numel(mc, tp) if mc.moe.enabled else 0)


def memory_lower_bound(cfg: Config, c: Choice, e: int, cache: Optional[dict] = None
                       ) -> float:
    """No more than the plan's peak: the larger of the average stage's model states and
    stage 0's model states + the activations it keeps on the device (its fewest blocks, the
    micro-batches in flight under 1F1B — ZB-H1's stage 0 holds as many; under ZB-V its two
    chunks, the tied embedding and LM head one parameter, and the most chunk micro-batches its
    order keeps live (`max_in_flight`) — a recomputed block's input only, an offloaded block
    nothing; the family's bytes at the rank's s/cp positions). `cache`: the elements per
    (tp, ep), kept between calls of one configuration."""
    mc, t = cfg.model, cfg.train
    fam = family(mc)
    h, vocab = mc.n_embd, padded_vocab_size(mc.vocab_size, c.tp)
    cache = {} if cache is None else cache
    if (c.tp, c.ep) not in cache:
        cache[(c.tp, c.ep)] = _rank_numel(mc, c.tp, c.ep)
    layer, embeddings = cache[(c.tp, c.ep)]
    v_shape = c.schedule == "zb-v"  # stage 0 holds both ends: no second copy of the head
    head_copy = vocab // c.tp * h if not mc.tie_word_embeddings or (c.pp > 1 and not v_shape) else 0
    average = (mc.n_layer * layer + embeddings + head_copy) / c.pp
    lay = Layout(tp_size=c.tp, pp_size=c.pp, dp_size=c.dp, cp_size=c.cp, zero_stage=c.zero)
    kept = 1 - offload_fraction(cfg, c)  # of the owned optimizer range (and zero 2/3 grads)

    # the experts' states shard over EDP = tp·cp·dp / ep, the rest over DP x CP: both at the
    # larger of the two is no more than the plan's
    sharded = max(lay.grad_replicas, c.tp * c.cp * c.dp // c.ep)

    def states(psi: float) -> float:
        b = model_state_bytes(lay, psi, e, sharded)
        return b["params"] + b["grads"] * (kept if lay.shards_gradients else 1) \
            + b["optimizer"] * kept
    layers = mc.n_layer // (c.pp * c.virtual_stages)
    if cfg.parallel.edge_stage_layers is not None:
        layers = min(layers, cfg.parallel.edge_stage_layers)
    first = states((2 if v_shape else 1) * layers * layer + embeddings)
    recomputed = 0 if not c.recompute else layers if c.recompute_layers is None \
        else min(c.recompute_layers, layers)
    offloaded = 0 if not c.offload else len(range(recomputed, layers)) \
        if c.offload_layers is None else max(0, min(layers, recomputed + c.offload_layers)
                                             - recomputed)
    seq = t.seq_len // c.cp  # a rank's positions (CP attention's own bytes left out)
    # the smaller kind of block (an MoE model's dense first blocks; EP folded over TP)
    full = min(fam.block_activation_bytes(mc, i, seq, c.micro_batch_size, c.tp, c.sp, e,
                                          mc.resid_pdrop > 0, ep=c.ep)
               for i in {0, typical_block(cfg)})
    s_local = seq // c.tp if c.sp else seq
    per_chunk = recomputed * e * s_local * c.micro_batch_size * h \
        + (layers - recomputed - offloaded) * full
    m = t.global_batch_size // (c.micro_batch_size * c.dp)
    first += (max_in_flight(c.pp, 0, m, 2, "zb-v") if v_shape else min(c.pp, m)) * per_chunk
    return max(states(average), first)


def _rank_numel(mc, tp: int, ep: int) -> Tuple[int, int]:
    """(a block's elements a rank holds: E/ep of the routed experts, the first stage's
    embedding elements)."""
    fam = family(mc)
    layer = fam.block_numel(mc, tp)
    if ep > 1:  # E/ep of the routed experts a rank, whole (expert TP = 1)
        layer += _expert_numel(mc, 1) // ep - _expert_numel(mc, tp)
    return layer, sum(local_numel(s, tp) for _, s in fam.first_specs(mc, tp))


def _expert_numel(mc, tp: int) -> int:
    """One block's routed experts' elements (block 0's specs, as `block_numel`)."""
    return sum(local_numel(s, tp) for _, s in family(mc).block_specs(mc, 0, tp) if s.expert)


def mask_factor(cfg: Config, c: Choice, profile: DeviceProfile,
                work: Optional[MaskedWork]) -> float:
    """The document mask's factor on a block's attention time that `predict` charges `c`
    (`megalite.plan.document_terms.masking`: the cp = 1 kernel's work × its ratio, or the
    CP kernel's slowest-rank work at c's cp_comm and micro-batch); 1 for causal attention."""
    mask = masking(apply_choice(cfg, c), Layout(cp_size=c.cp), profile, work)
    return 1.0 if mask is None else mask["factor"]


def smallest_latency(profile: DeviceProfile) -> float:
    """The smallest latency a ring step of any collective pays on `profile`
    (`megalite.plan.links.ring_step_s`: a collective over n ranks pays n − 1 of them at
    least)."""
    steps = [ring_step_s(profile.intra_node), ring_step_s(profile.inter_node)] + [
        ring_step_s(link, op) for ops in profile.op_links.values() for op, link in ops.items()]
    return min(steps)


@dataclass
class TimeBound:
    """`time_lower_bound` of one search's candidates: the compute dtype's bytes `e` and a
    matmul `rate` no prediction is faster than (FP8's where the run's linears use it), each
    TP group's fastest bus (its link and its collectives' fits) and each (cp, cp_comm,
    micro-batch)'s `mask_factor`, cached."""

    cfg: Config
    profile: DeviceProfile
    gpus_per_node: int
    masked_work: Optional[MaskedWork]
    e: int
    rate: float
    flops: dict = field(default_factory=dict)
    buses: dict = field(default_factory=dict)
    factors: dict = field(default_factory=dict)
    bounds: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: Config, profile: DeviceProfile, gpus_per_node: int,
           masked_work: Optional[MaskedWork]) -> "TimeBound":
        device_type, bf16 = device_kind(profile)
        precision = Layout.from_config(replace(cfg, tp=1, cp=1, pp=1), 1, device_type,
                                       bf16).precision
        rate = profile.rate(precision)
        if cfg.fp8.recipe != "none" and "fp8" in profile.matmul_tflops:
            rate = max(rate, profile.rate("fp8"))
        return cls(cfg, profile, gpus_per_node, masked_work,
                   4 if precision == "fp32" else 2, rate)

    def __call__(self, c: Choice) -> float:
        """Cached per what the bound depends on (not the offloads)."""
        key = (c.tp, c.cp, c.cp_comm, c.pp, c.dp, c.sp, c.virtual_stages, c.micro_batch_size,
               c.recompute, c.recompute_layers, c.schedule, c.zero, c.ep)
        bound = self.bounds.get(key)
        if bound is None:
            bound = self.bounds[key] = self._bound(c)
        return bound

    def layout(self, sizes: tuple) -> float:
        """No grid of the layout (tp, cp, cp_comm, pp, dp) has a smaller `time_lower_bound`:
        the largest stage's busy time is no less than the stages' mean, whose sum over the
        stages is that of the whole model whatever the schedule, partition, micro-batch size
        (m × a micro-batch's compute, TP and CP wire bytes do not change with it; latencies
        at m = 1), recompute (none), sp (off: the fewest TP bytes and collectives) and zero
        (0: no reduce-scatter stream). 0 under a document mask (its factor may be < 1)."""
        if self.masked_work is not None:
            return 0.0
        tp, cp, comm, pp, dp = sizes
        c = Choice(tp, pp, dp, 0, False, 1, 1, False, False, cp=cp, cp_comm=comm)
        mc, t, n = self.cfg.model, self.cfg.train, self.cfg.model.n_layer
        m = t.global_batch_size // dp  # at micro-batch 1
        if "model" not in self.flops:  # the whole model's forward FLOPs a token
            whole = replace(self.cfg, parallel=replace(self.cfg.parallel,
                                                       edge_stage_layers=None))
            self.flops["model"] = sum(f for f, *_ in _stage_flops({}, whole, replace(
                c, pp=1, virtual_stages=1, schedule="auto")))
        total = self.flops["model"]
        buses = self.links(c)
        seq = t.seq_len / cp
        ring = (tp - 1) / tp * self.e * seq * mc.n_embd / (buses["tp"] * 1e9)
        cp_count = 0 if cp == 1 else 2 * (cp - 1) if comm == "allgather" else cp
        wire = _cp_wire_s(self.cfg, c, self.e, buses)
        busy = m * (3 * total * seq / tp / self.rate + ring * n * 8 + sum(wire) * n) \
            + n * (4 * (tp - 1) * buses["tp_latency"]
                   + cp_count * smallest_latency(self.profile))
        return busy / pp

    def links(self, c: Choice) -> dict:
        """The bus GB/s of c's groups, as `time_lower_bound` takes them (cached)."""
        sizes = (c.tp, c.cp, c.pp, c.dp, c.rank_order)  # the order places the dp group
        if sizes not in self.buses:
            links = group_links(Layout(tp_size=c.tp, pp_size=c.pp, dp_size=c.dp, cp_size=c.cp,
                                       rank_order=c.rank_order),
                                self.profile, self.gpus_per_node)
            tp = links["tp"]
            self.buses[sizes] = {
                "tp": max([tp.link.bus_gbps] + [fit.bus_gbps for fit in tp.ops.values()]),
                "tp_latency": min([ring_step_s(tp.link)] + [ring_step_s(fit, op) for op, fit
                                                             in tp.ops.items()]),
                "dp": links["dp"].of("reduce_scatter").bus_gbps,
                "dp_all_gather": links["dp"].of("all_gather").bus_gbps,
                "cp_all_gather": links["cp"].of("all_gather").bus_gbps,
                "cp_reduce_scatter": links["cp"].of("reduce_scatter").bus_gbps,
                "cp_send": links["cp_send"].of("send_recv").bus_gbps}
        return self.buses[sizes]

    def _bound(self, c: Choice) -> float:
        buses = self.links(c)
        key = (c.cp, c.cp_comm, c.micro_batch_size)
        if key not in self.factors:
            self.factors[key] = mask_factor(self.cfg, c, self.profile, self.masked_work)
        return time_lower_bound(self.cfg, c, self.rate, self.flops, self.e, buses["tp"],
                                self.factors[key], smallest_latency(self.profile), buses,
                                self.per_block(c))

    def per_block(self, c: Choice) -> Tuple[float, float]:
        """(a block pass's seconds beyond its FLOPs, a block's gradient accumulation seconds)
        a micro-batch, no more than `predict` charges: the profile's block pass with the
        residual dropout's correction at its smallest over sp (time_model's), at least 0;
        e + 8 bytes a parameter of the rank's block (its E/ep experts) at the HBM rate."""
        key = (c.tp, c.cp, c.micro_batch_size, c.ep)
        if key not in self.blocks:
            p, mc = self.profile, self.cfg.model
            tokens = c.micro_batch_size * self.cfg.train.seq_len // c.cp
            hbm = p.hbm_gbps * 1e9 if p.hbm_gbps else None
            measured = fits_dropout(p.block_fits)
            dropout = 0.0
            if measured is not None and hbm and (measured > 0) != dropout_on(self.cfg):
                sign = 1 if dropout_on(self.cfg) else -1
                site = tokens * mc.n_embd / (c.tp if sign > 0 else 1)
                dropout = sign * 2 * site * dropout_bytes(self.e) / hbm
            accumulate = (self.e + 8) * _rank_numel(mc, c.tp, c.ep)[0] / hbm if hbm else 0.0
            self.blocks[key] = (max(0.0, p.block_pass_s(mc.n_embd, tokens, c.tp) + dropout),
                                accumulate)
        return self.blocks[key]
