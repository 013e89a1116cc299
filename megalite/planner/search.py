"""Search over layouts: which (tp, pp, dp, zero, sp, virtual stages, micro-batch size,
recompute, activation offload) trains a model fastest on N devices of one profile.

The space (`candidates`): tp and pp whose product divides the world size, tp dividing the
heads, the width and the MLP; zero 0-3 (1-3 only with dp > 1: with dp = 1 they shard
nothing); sp with tp > 1; virtual stages v > 1 with pp > 1 where pp·v divides the blocks; every
micro-batch size that divides the per-replica batch; recompute off or of every block;
offload.activations off, or on where blocks are not all recomputed, and offload.optimizer off
or on (the configuration's fraction, else 1) — offloads on GPUs only: on CPU they save nothing.
Other keys (bucket size, reshard_after_forward, overlap_param_gather,
edge_stage_layers, ...) are the configuration's own.

Each candidate passes the launch validation (`megalite.layout.validate`) and the memory plan
(`megalite.plan.make_plan`: every stage's estimate within the device memory) before it is
proposed. To answer in seconds for thousands of devices, candidates are pruned on a memory
lower bound (model states of the average stage + the activations a stage-0 rank holds) and
then costed best-first by a time lower bound (compute + recompute + the bubble, which the
prediction adds communication to): the search stops once the next lower bound exceeds the
k-th best prediction, so the ranking it returns is the exact top k of the whole space.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from megalite.config import Config, ConfigError
from megalite.layout import Layout, validate
from megalite.parallel.param_spec import padded_vocab_size
from megalite.parallel.schedule import expected_bubble
from megalite.plan import GIB, Plan, layer_activation_bytes, make_plan, model_state_bytes
from megalite.planner.devices import DeviceProfile
from megalite.planner.time_model import Prediction, predict, stage_forward_flops
from megalite.planner.traffic import stage_traffic


@dataclass(frozen=True, order=True)
class Choice:
    tp: int
    pp: int
    dp: int
    zero: int
    sp: bool
    virtual_stages: int
    micro_batch_size: int
    recompute: bool
    offload: bool  # offload.activations
    offload_optimizer: bool = False  # offload.optimizer (the configuration's fraction, or 1)

    @property
    def family(self) -> str:
        return (f"zero={self.zero} recompute={'on' if self.recompute else 'off'}"
                + (" offload.activations" if self.offload else "")
                + (" offload.optimizer" if self.offload_optimizer else ""))

    def overrides(self) -> List[str]:
        """The command-line overrides that select this layout."""
        out = [f"tp={self.tp}", f"pp={self.pp}", f"zero={self.zero}",
               f"sp={str(self.sp).lower()}", f"parallel.virtual_stages={self.virtual_stages}",
               f"train.micro_batch_size={self.micro_batch_size}",
               f"train.recompute={str(self.recompute).lower()}"]
        return out + (["offload.activations=true"] if self.offload else []) \
            + (["offload.optimizer=1"] if self.offload_optimizer else [])

    def describe(self) -> str:
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} zero={self.zero} sp={self.sp} "
                f"v={self.virtual_stages} mb={self.micro_batch_size} "
                f"recompute={self.recompute}" + (" offload" if self.offload else "")
                + (" offload.optimizer" if self.offload_optimizer else ""))


@dataclass
class Ranked:
    choice: Choice
    config: Config
    layout: Layout
    plan: Plan
    prediction: Prediction

    @property
    def peak_bytes(self) -> float:
        return self.plan.peak.bytes["total"]


@dataclass
class SearchResult:
    best: List[Ranked]  # fastest first
    valid: int  # candidates that pass the launch validation rules the search enumerates
    costed: int  # predicted (the rest were pruned by a bound)
    too_big: Dict[str, float] = field(default_factory=dict)  # family -> least bytes a
    #                                                           non-fitting layout needs
    too_big_count: Dict[str, int] = field(default_factory=dict)  # family -> how many
    invalid: Dict[str, int] = field(default_factory=dict)  # validation message -> count
    # (peak bytes per rank, step s, kind): "planned" (both exact), "predicted" (memory a
    # lower bound), "bound" (both lower bounds)
    points: List[Tuple[float, float, str]] = field(default_factory=list)


def apply_choice(cfg: Config, c: Choice) -> Config:
    """`cfg` with the layout keys of `c` (a shallow copy: the sections that change are new)."""
    offload = replace(cfg.offload, activations=c.offload, activations_layers=None,
                      optimizer=offload_fraction(cfg, c))
    return replace(cfg, tp=c.tp, pp=c.pp, zero=c.zero, sp=c.sp,
                   parallel=replace(cfg.parallel, virtual_stages=c.virtual_stages),
                   train=replace(cfg.train, micro_batch_size=c.micro_batch_size,
                                 recompute=c.recompute, recompute_layers=None),
                   offload=offload)


def offload_fraction(cfg: Config, c: Choice) -> float:
    """offload.optimizer of a candidate: the configuration's fraction where it sets one."""
    return (cfg.offload.optimizer or 1.0) if c.offload_optimizer else 0.0


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Config, world: int, on_gpu: bool, fixed: Optional[Dict] = None
               ) -> List[Choice]:
    """The search space (module docstring), with the fields named in `fixed` held."""
    fixed = fixed or {}
    m, t = cfg.model, cfg.train
    out = []
    for tp in _divisors(world):
        if m.n_head % tp or m.n_embd % tp or m.ffn_size % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > m.n_layer:
                continue
            dp = world // (tp * pp)
            if t.global_batch_size % dp:
                continue
            for zero in (range(4) if dp > 1 else (0,)):
                for sp in ((False, True) if tp > 1 and t.seq_len % tp == 0 else (False,)):
                    for v in _virtual(m.n_layer, pp):
                        for mb in _divisors(t.global_batch_size // dp):
                            micro = t.global_batch_size // (mb * dp)
                            if v > 1 and micro % pp:
                                continue
                            for rec, off, opt in itertools.product(
                                    (False, True), (False, True) if on_gpu else (False,),
                                    (False, True) if on_gpu else (False,)):
                                if off and rec:
                                    continue
                                c = Choice(tp, pp, dp, zero, sp, v, mb, rec, off, opt)
                                if all(getattr(c, k) == x for k, x in fixed.items()):
                                    out.append(c)
    return out


def _virtual(n_layer: int, pp: int) -> List[int]:
    if pp == 1:
        return [1]
    return [v for v in _divisors(n_layer // pp) if n_layer % (pp * v) == 0] \
        if n_layer % pp == 0 else [1]


def _stage_flops(cache: dict, cfg: Config, pp: int, v: int, recompute: bool
                 ) -> Tuple[tuple, ...]:
    """Per stage (model, recompute) forward FLOPs per token, cached per (pp, v, recompute)."""
    key = (pp, v, recompute)
    if key not in cache:
        c = replace(cfg, pp=pp, parallel=replace(cfg.parallel, virtual_stages=v),
                    train=replace(cfg.train, recompute=recompute, recompute_layers=None))
        cache[key] = tuple((f["model"], f["recompute"]) for f in stage_forward_flops(
            c, Layout(pp_size=pp, virtual_stages=v)))
    return cache[key]


def time_lower_bound(cfg: Config, c: Choice, rate: float, cache: dict) -> float:
    """compute + recompute of the busiest stage, over 1 − bubble: no prediction is lower."""
    flops = _stage_flops(cache, cfg, c.pp, c.virtual_stages, c.recompute)
    m = cfg.train.global_batch_size // (c.micro_batch_size * c.dp)
    tokens = m * c.micro_batch_size * cfg.train.seq_len / c.tp / rate
    busiest = max((3 * f + r) * tokens for f, r in flops)
    return busiest / (1 - expected_bubble(c.pp, m, c.virtual_stages))


def memory_lower_bound(cfg: Config, c: Choice, e: int) -> float:
    """No more than the plan's peak: the larger of the average stage's model states and
    stage 0's model states + the activations it holds (its fewest blocks, the micro-batches
    in flight under 1F1B, a recomputed block's input only)."""
    mc, t = cfg.model, cfg.train
    h, f, vocab = mc.n_embd, mc.ffn_size, padded_vocab_size(mc.vocab_size, c.tp)
    layer = 4 * h + (3 * h * h + 3 * h) // c.tp + h * h // c.tp + h + (f * h + f) // c.tp \
        + h * f // c.tp + h
    embeddings = vocab // c.tp * h + mc.n_positions * h
    average = (mc.n_layer * layer + embeddings + (vocab // c.tp * h if c.pp > 1 else 0)) / c.pp
    lay = Layout(tp_size=c.tp, pp_size=c.pp, dp_size=c.dp, zero_stage=c.zero)
    kept = 1 - offload_fraction(cfg, c)  # of the owned optimizer range (and zero 2/3 grads)

    def states(psi: float) -> float:
        b = model_state_bytes(lay, psi, e)
        return b["params"] + b["grads"] * (kept if lay.shards_gradients else 1) \
            + b["optimizer"] * kept
    layers = mc.n_layer // (c.pp * c.virtual_stages)
    if cfg.parallel.edge_stage_layers is not None:
        layers = min(layers, cfg.parallel.edge_stage_layers)
    first = states(layers * layer + embeddings)
    if not c.offload:
        full = layer_activation_bytes(t.seq_len, c.micro_batch_size, h, mc.n_head, c.tp, c.sp,
                                      e, mc.resid_pdrop > 0)
        s_local = t.seq_len // c.tp if c.sp else t.seq_len
        per_layer = e * s_local * c.micro_batch_size * h if c.recompute else full
        m = t.global_batch_size // (c.micro_batch_size * c.dp)
        first += min(c.pp, m) * layers * per_layer
    return max(states(average), first)


class NothingFits(ValueError):
    """No layout of the space fits the device memory; names each family's least need."""


def device_kind(profile: DeviceProfile) -> Tuple[str, bool]:
    """(Layout device type, computes in bf16) of a profile."""
    return ("cpu" if profile.device == "cpu" else "cuda"), "bf16" in profile.matmul_tflops


@dataclass
class _Search:
    cfg: Config
    world: int
    profile: DeviceProfile
    gpus_per_node: int
    result: SearchResult = field(default_factory=lambda: SearchResult([], 0, 0))

    def predicted(self, c: Choice) -> Optional[Tuple[Config, Layout, Prediction]]:
        """Validate and predict one candidate (traffic only, no memory peak); None when
        the launch validation refuses it."""
        device_type, bf16 = device_kind(self.profile)
        cfg = apply_choice(self.cfg, c)
        try:
            validate(cfg, self.world, self.gpus_per_node if device_type == "cuda" else None)
        except ConfigError as err:
            self.result.invalid[str(err)] = self.result.invalid.get(str(err), 0) + 1
            return None
        layout = Layout.from_config(cfg, self.world, device_type, bf16)
        self.result.costed += 1
        return cfg, layout, predict(cfg, layout, stage_traffic(cfg, layout), self.profile,
                                    self.gpus_per_node)

    def planned(self, c: Choice, cfg: Config, layout: Layout, pred: Prediction
                ) -> Optional[Ranked]:
        """The memory plan of a predicted candidate; None when some stage does not fit."""
        plan = make_plan(cfg, layout)
        self.result.points.append((plan.peak.bytes["total"], pred.step_s, "planned"))
        if plan.peak.bytes["total"] > self.profile.memory_bytes:
            self.too_big(c.family, plan.peak.bytes["total"])
            return None
        return Ranked(c, cfg, layout, plan, pred)

    def too_big(self, family: str, need: float) -> None:
        self.result.too_big[family] = min(need, self.result.too_big.get(family, need))
        self.result.too_big_count[family] = self.result.too_big_count.get(family, 0) + 1


def search(cfg: Config, world: int, profile: DeviceProfile, gpus_per_node: int,
           top: int = 5, fixed: Optional[Dict] = None) -> SearchResult:
    """The `top` fastest predicted layouts that validate and fit (module docstring);
    NothingFits when none does.

    One queue, smallest key first: a candidate enters keyed by its time lower bound; popped,
    it is predicted and re-enters keyed by its prediction (never below its bound); popped
    again, its memory is planned and, if it fits, it is the next fastest of the whole space."""
    device_type, bf16 = device_kind(profile)
    precision = Layout.from_config(replace(cfg, tp=1, pp=1), 1, device_type, bf16).precision
    e, rate = (4 if precision == "fp32" else 2), profile.rate(precision)
    s = _Search(cfg, world, profile, gpus_per_node)
    cache: dict = {}
    queue, smallest = [], {}
    for c in candidates(cfg, world, device_type == "cuda", fixed):
        need = memory_lower_bound(cfg, c, e)
        if need > profile.memory_bytes:
            s.too_big(c.family, need)
            s.result.points.append((need, time_lower_bound(cfg, c, rate, cache), "bound"))
            if need < smallest.get(c.family, (float("inf"),))[0]:
                smallest[c.family] = (need, c)
            continue
        queue.append((time_lower_bound(cfg, c, rate, cache), c, None))
    heapq.heapify(queue)
    s.result.valid = len(queue)
    while queue and len(s.result.best) < top:
        key, c, predicted = heapq.heappop(queue)
        if predicted is None:
            predicted = s.predicted(c)
            if predicted is not None:
                heapq.heappush(queue, (predicted[2].step_s, c, predicted))
            continue
        ranked = s.planned(c, *predicted)
        if ranked is not None:
            s.result.best.append(ranked)
    for key, c, predicted in queue:  # not planned: their bounds
        s.result.points.append((memory_lower_bound(cfg, c, e), key,
                                "bound" if predicted is None else "predicted"))
    if not s.result.best:
        for family, (_, c) in smallest.items():  # the plan's figure for the least-need one
            predicted = s.predicted(c)
            if predicted is not None:
                s.planned(c, *predicted)
        raise NothingFits(nothing_fits_message(s.result, profile, world))
    return s.result


def nothing_fits_message(result: SearchResult, profile: DeviceProfile, world: int) -> str:
    lines = [f"no layout of {world} ranks fits {profile.name}'s "
             f"{profile.memory_bytes / GIB:.1f} GiB per device; the least memory per rank "
             "each family of layouts needs:"]
    lines += [f"  {family}: {need / GIB:.1f} GiB"
              for family, need in sorted(result.too_big.items(), key=lambda x: x[1])]
    for message, count in result.invalid.items():
        lines.append(f"  ({count} candidates refused by the launch validation: {message})")
    lines.append("use more devices, a larger memory device, or a smaller micro-batch/"
                 "sequence/global batch")
    return "\n".join(lines)
