"""Search over layouts: which (tp, cp and its comm, pp, dp, zero, sp, virtual stages,
micro-batch size, pipeline schedule, recompute, offloads) trains a model fastest on N devices of one profile.

The space is `megalite.plan.space.candidates` (its docstring lists it). Each candidate
passes the launch validation (`megalite.config.layout.validate`, which also applies the schedule's
refusals of `megalite.config.schedule_rules`) and the memory plan (`megalite.plan.memory.make_plan`: every
stage's estimate within the device memory) before it is proposed. To answer in seconds for
thousands of devices (and the hundreds of thousands of layouts of 16,384), candidates are
queued best-first by a time lower bound (compute + recompute + the idle time the schedule must
leave, which the prediction adds communication to; `megalite.plan.search_bounds`), each checked
against a memory lower bound (model states of the average stage + the activations a stage-0
rank keeps on the device) only when it is reached, then predicted, then planned: the search
stops once the next lower bound exceeds the
k-th best prediction, so the ranking it returns is the exact top k of the whole space.

Under train.attention_mask=document every prediction prices the masked kernel with the run's
masked work (`megalite.plan.document_terms.MaskedWork`, sampled once per search by the caller:
`megalite.plan.auto.search_recipes`), and the bounds (`megalite.plan.search_bounds`) charge
each candidate's attention × its own mask factor.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from megalite.config.errors import ConfigError
from megalite.config.layout import Layout, validate
from megalite.config.schema import Config
from megalite.plan.devices import DeviceProfile
from megalite.plan.document_terms import MaskedWork
from megalite.plan.fit import fewest_offloaded_blocks
from megalite.plan.memory import GIB, Plan, make_plan
from megalite.plan.search_bounds import TimeBound, device_kind, memory_lower_bound
from megalite.plan.space import Choice, Grid, apply_choice, layout_grids, layout_sizes
from megalite.plan.stage_time import device_step_s_per_param, host_step_s_per_param
from megalite.plan.time_model import Prediction, predict
from megalite.plan.traffic import stage_traffic


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
    valid: int  # candidates reached whose memory bound fits (the rest of the space was not
    #             reached: its time bound exceeds the k-th best prediction)
    costed: int  # predicted (the rest were pruned by a bound)
    too_big: Dict[str, float] = field(default_factory=dict)  # family -> least bytes a
    #                                                           non-fitting layout needs
    too_big_count: Dict[str, int] = field(default_factory=dict)  # family -> how many
    invalid: Dict[str, int] = field(default_factory=dict)  # validation message -> count
    # (peak bytes per rank, step s, kind): "planned" (both exact), "predicted" (memory a
    # lower bound), "bound" (both lower bounds)
    points: List[Tuple[float, float, str]] = field(default_factory=list)
    masked_work: Optional[MaskedWork] = None  # what the predictions priced the mask with
    unreached: int = 0  # queued by their time bound, never reached (nor memory-checked)
    unexpanded: int = 0  # layouts (tp, cp, cp_comm, pp, dp) whose bound (`TimeBound.layout`,
    #                      below each of their grids') was never reached: grids never made


class NothingFits(ValueError):
    """No layout of the space fits the device memory; names each family's least need."""


@dataclass
class _Search:
    cfg: Config
    world: int
    profile: DeviceProfile
    gpus_per_node: int
    masked_work: Optional[MaskedWork] = None  # train.attention_mask=document: the run's
    result: SearchResult = field(default_factory=lambda: SearchResult([], 0, 0))

    def prediction(self, cfg: Config, layout: Layout) -> Prediction:
        return predict(cfg, layout, stage_traffic(cfg, layout), self.profile,
                       self.gpus_per_node, masked_work=self.masked_work)

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
        return cfg, layout, self.prediction(cfg, layout)

    def least_offload_s(self, c: Choice, pred: Prediction) -> float:
        """The step of `c` (predicted `pred`) with one block's activations offloaded: no
        refined offload count of it (at least 1, `planned`) is faster."""
        if c.offload_layers == 1:
            return pred.step_s
        cfg = apply_choice(self.cfg, replace(c, offload_layers=1))
        device_type, bf16 = device_kind(self.profile)
        return self.prediction(cfg, Layout.from_config(cfg, self.world, device_type,
                                                        bf16)).step_s

    def planned(self, c: Choice, cfg: Config, layout: Layout, pred: Prediction
                ) -> Optional[Ranked]:
        """The memory plan of a predicted candidate; None when some stage does not fit. A
        fitting candidate with activation offload takes the fewest first blocks that fit
        (`fewest_offloaded_blocks`: the space tries a few counts; fewer offloaded blocks
        are never slower in the time model, and their copies hide under the blocks kept on
        the device)."""
        plan = make_plan(cfg, layout)
        self.result.points.append((plan.peak.bytes["total"], pred.step_s, "planned"))
        memory = self.profile.memory_bytes
        if plan.peak.bytes["total"] > memory:
            self.too_big(c.family, plan.peak.bytes["total"])
            return None
        if c.offload:
            found = fewest_offloaded_blocks(cfg, layout,
                                            lambda p: p.peak.bytes["total"] <= memory)
            fewest = None if found is None else found[0].offload.activations_layers
            if found is not None and fewest != cfg.offload.activations_layers:
                cfg, plan = found
                c = replace(c, offload_layers=fewest)
                pred = self.prediction(cfg, layout)
        return Ranked(c, cfg, layout, plan, pred)

    def too_big(self, family: str, need: float) -> None:
        self.result.too_big[family] = min(need, self.result.too_big.get(family, need))
        self.result.too_big_count[family] = self.result.too_big_count.get(family, 0) + 1


def search(cfg: Config, world: int, profile: DeviceProfile, gpus_per_node: int,
           top: int = 5, fixed: Optional[Dict] = None,
           masked_work: Optional[MaskedWork] = None) -> SearchResult:
    """The `top` fastest predicted layouts that validate and fit (module docstring);
    NothingFits when none does. `masked_work`: under train.attention_mask=document, the
    fractions the mask leaves (`megalite.plan.document_terms.masked_work`; default, as
    `predict`'s, `NO_SAVING`).

    One queue, smallest key first: a candidate enters keyed by its time lower bound; popped,
    it is predicted and re-enters keyed by its prediction (never below its bound); popped
    again, its memory is planned and, if it fits, it is the next fastest of the whole space.
    Offloads only add copy time (`_Offloads`), so a layout's offload variants enter only once
    every variant with less offload is known not to fit."""
    s = _Search(cfg, world, profile, gpus_per_node, masked_work)
    s.result.masked_work = masked_work
    walk = _walk(s)
    held = {k: v for k, v in (fixed or {}).items() if k in ("tp", "cp", "cp_comm", "pp", "dp")}
    for sizes in layout_sizes(cfg, world):
        if all(dict(zip(("tp", "cp", "cp_comm", "pp", "dp"), sizes))[k] == v
               for k, v in held.items()):
            walk.queue.append((walk.bound.layout(sizes), next(walk.order), None, None, sizes,
                               None))
    queue = walk.queue
    heapq.heapify(queue)
    walk.heap = True
    while queue and len(s.result.best) < top:
        key, n, c, predicted, grid, cell = heapq.heappop(queue)
        if c is None:  # a layout (tp, cp, cp_comm, pp, dp) reached: its grids
            for g in layout_grids(cfg, grid, walk.offloads, fixed):
                walk.start(g)
            continue
        if isinstance(predicted, Ranked):  # planned (an offload's count refined): ranked
            if all(r.choice != predicted.choice for r in s.result.best):
                s.result.best.append(predicted)
            continue
        if isinstance(predicted, _Refine):
            _push_refined(s, walk, queue, (n, c, predicted.predicted, grid, cell))
            continue
        if predicted is None:  # not yet checked against the memory
            walk.check_memory(key, n, c, grid, cell)
            continue
        if not isinstance(predicted, tuple):  # its memory bound: not predicted yet
            predicted = s.predicted(c)
            if predicted is None:
                walk.not_fitting(grid, *cell)
            elif c.offload:  # refined once its least-offload time is reached (`_Refine`)
                heapq.heappush(queue, (s.least_offload_s(c, predicted[2]), n, c,
                                       _Refine(predicted), grid, cell))
            else:
                heapq.heappush(queue, (predicted[2].step_s, n, c, predicted, grid, cell))
            continue
        ranked = s.planned(c, *predicted)
        if ranked is None:
            walk.not_fitting(grid, *cell)
        elif all(r.choice != ranked.choice for r in s.result.best):
            s.result.best.append(ranked)
    return _finish(s, walk)


@dataclass
class _Refine:
    """A predicted activation-offload candidate queued at its least-offload step
    (`_Search.least_offload_s`), to be planned and refined when that is reached: most never
    are, and planning is the search's dearest step."""

    predicted: Tuple[Config, Layout, Prediction]


def _push_refined(s: "_Search", walk: "_Offloads", queue: list, entry: tuple) -> None:
    """Plan a predicted activation-offload candidate now and queue it at the prediction of
    its refined offload count (`_Search.planned`: fewer blocks may be faster), so that it is
    ranked among the others at the time it will report. (Refined only once popped in its
    time's turn, a candidate that became faster than ones already taken would be listed below
    them.) It was queued at its time with one offloaded block, so the refined time is never
    below the key just popped."""
    n, c, predicted, grid, cell = entry
    ranked = s.planned(c, *predicted)
    if ranked is None:
        walk.not_fitting(grid, *cell)
    else:
        heapq.heappush(queue, (ranked.prediction.step_s, n, ranked.choice, ranked, grid, cell))


def _walk(s: "_Search") -> "_Offloads":
    """The walk over the space for `s`: its time bound (`TimeBound`) and whether offloads are
    tried (on GPUs whose profile prices their copies)."""
    profile = s.profile
    bound = TimeBound.of(s.cfg, profile, s.gpus_per_node, s.masked_work)
    host = host_step_s_per_param(profile, bound.e, min(s.gpus_per_node, s.world))
    device = device_step_s_per_param(profile, bound.e)
    walk = _Offloads(s, bound, device is None or host is None
                     or host >= device + 4 / (profile.hbm_gbps * 1e9))
    walk.offloads = device_kind(profile)[0] == "cuda" and profile.prices_offload()
    return walk


def _finish(s: "_Search", walk: "_Offloads") -> SearchResult:
    """The result: the candidates left in the queue as points at their bounds; NothingFits
    (with the plan's figure for each family's least-need layout) when none fits."""
    for key, _, c, predicted, _, _ in walk.queue:  # not planned: their bounds
        if c is None:  # a layout never reached: its grids never made
            s.result.unexpanded += 1
            continue
        if predicted is None:  # never reached: no memory bound computed
            s.result.unreached += 1
            continue
        if isinstance(predicted, Ranked):
            s.result.points.append((predicted.peak_bytes, key, "planned"))
        else:
            s.result.points.append((memory_lower_bound(s.cfg, c, walk.e), key, "predicted")
                                   if isinstance(predicted, (tuple, _Refine))
                                   else (predicted, key, "bound"))
    if not s.result.best:
        for family, (_, c) in walk.smallest.items():  # the plan's figure for the least-need one
            predicted = s.predicted(c)
            if predicted is not None:
                s.planned(c, *predicted)
        raise NothingFits(nothing_fits_message(s.result, s.profile, s.world))
    return s.result


class _Offloads:
    """The walk over each layout's offload variants (`Grid`). In the time model more
    offloaded blocks only add copy time, and a larger optimizer fraction only moves the optimizer
    step to a host no faster than the device (`ordered_fractions`), the rest of the prediction equal:
    a variant is never faster than one with less offload (fewer blocks, no larger fraction).
    So a variant is examined (memory bound, then queued by its time bound) only when each
    variant just below it is out of the space, invalid or known not to fit (by its memory
    bound or its plan); the space's top k is that of the variants so examined."""

    def __init__(self, s: _Search, bound: TimeBound, ordered_fractions: bool):
        self.s, self.bound, self.e, self.ordered = s, bound, bound.e, ordered_fractions
        self.queue: list = []
        self.numel: dict = {}  # memory_lower_bound's cache
        self.order = itertools.count()  # ties: first examined first (Choices do not compare)
        self.smallest: Dict[str, Tuple[float, Choice]] = {}
        self.out: Dict[int, set] = {}  # id(grid) -> cells known not to fit
        self.heap = False  # the queue is a heap (after the first pass)
        self.offloads = False  # offloads are in the space

    def start(self, grid: Grid) -> None:
        """Examine the grid's least-offload variants: no offload (with unordered fractions,
        no activation offload at each fraction)."""
        for j in range(grid.shape[1] if not self.ordered else 1):
            self.examine(grid, 0, j)

    def examine(self, grid: Grid, i: int, j: int) -> None:
        """Queue the cell by its time bound; its memory bound waits until it is popped
        (`check_memory`): most cells of a large space are never reached."""
        c = grid.at(i, j)
        if c is None:  # out of the space: what lies above it may be in
            self.not_fitting(grid, i, j)
            return
        entry = (self.bound(c), next(self.order), c, None, grid, (i, j))
        if self.heap:
            heapq.heappush(self.queue, entry)
        else:
            self.queue.append(entry)

    def check_memory(self, key: float, n: int, c: Choice, grid: Grid, cell: tuple) -> None:
        """A popped cell's memory bound: over the device, the cells above it are examined;
        else it is queued again at its key, to be predicted."""
        need = memory_lower_bound(self.s.cfg, c, self.e, self.numel)
        if need > self.s.profile.memory_bytes:
            self.s.too_big(c.family, need)
            self.s.result.points.append((need, key, "bound"))
            if need < self.smallest.get(c.family, (float("inf"),))[0]:
                self.smallest[c.family] = (need, c)
            self.not_fitting(grid, *cell)
            return
        self.s.result.valid += 1
        heapq.heappush(self.queue, (key, n, c, need, grid, cell))

    def not_fitting(self, grid: Grid, i: int, j: int) -> None:
        """(i, j) is out of the space, invalid or does not fit: examine the variants above it
        whose every variant just below is so too."""
        out = self.out.setdefault(id(grid), set())
        out.add((i, j))
        rows, cols = grid.shape
        above = [(i + 1, j)] + ([(i, j + 1)] if self.ordered else [])
        for a, b in above:
            if a < rows and b < cols and (a == 0 or (a - 1, b) in out) and \
                    (not self.ordered or b == 0 or (a, b - 1) in out):
                self.examine(grid, a, b)


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
