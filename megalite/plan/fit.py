"""The cheapest placement that makes a layout fit the device's memory: the plan names it next
to a stage that does not fit, and a planner's layout search can call it for each candidate.

`cheapest_fit(cfg, layout, device_bytes, profile)` tries placement changes of the states the design
names (P, G, O, A: ZeRO sharding, offload, recompute), alone and in pairs, keeps those under
which every pipeline stage's planned total (`megalite.plan.memory.make_plan`) is at most
`device_bytes`, and returns the one with the smallest estimated added time per step. Pure: it
reads the configuration and plans, nothing else.

Activation offload is tried as its fewest blocks that fit (`fewest_offloaded_blocks`: the
first k of each chunk, `offload.activations_layers=k`, k found by bisection — more offloaded
blocks only lower the plan and only add copies): the first blocks' copies hide under the
forward and backward of the blocks kept after them as far as the copy rates allow, so the
fewest that fit are the cheapest, and every block (`offload.activations=true` alone) is
offered only where nothing less fits.

The added time of a candidate is the time model's (`megalite.plan.time_model.predict`, on the
caller's device profile): its predicted step less the layout's, so a placement is charged as
the planner charges it everywhere — ZeRO's extra DP traffic beyond what the backward hides,
offload.optimizer's gradient and parameter copies at the profile's pinned copy rates and its
host step at the profile's host AdamW rate, recompute's re-run forward (FLOPs and its blocks'
non-matmul time), activation offload's copies beyond the compute they overlap. There is one
offload cost model, the time model's; nothing here has rates of its own.

Changing tp, cp, pp, dp or the micro-batch size changes the layout itself: that is the search's
business, not a placement.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.plan.devices import DeviceProfile
from megalite.plan.dims import recomputed_layers
from megalite.plan.memory import Plan, make_plan
from megalite.plan.time_model import predict

OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Suggestion:
    overrides: Tuple[str, ...]  # the config overrides (empty: it fits as it is)
    added_s: float  # estimated added seconds per step
    device_bytes: float  # the busiest stage's planned total under it, per rank
    host_bytes: float  # the host memory it takes per rank (busiest stage)

    def describe(self) -> str:
        if not self.overrides:
            return "fits as it is"
        return (f"{' '.join(self.overrides)} (about {self.device_bytes / 2**30:.1f} GiB per "
                f"rank, {self.host_bytes / 2**30:.1f} GiB of host memory, ~{self.added_s:.3f} "
                "s more per step)")


Change = Tuple[str, Optional[Callable[[Config, Layout], Tuple[Config, Layout]]]]


def _changes(cfg: Config, layout: Layout) -> List[List[Change]]:
    """Candidate changes (override text, how it applies) grouped by the state they move: a
    combination takes one change of a group at most."""
    t = cfg.train

    def zero(z):
        return lambda c, lo: (replace(c, zero=z), replace(lo, zero_stage=z))

    def optimizer(f):
        return lambda c, lo: (replace(c, offload=replace(c.offload, optimizer=f)), lo)

    def recompute(r):
        return lambda c, lo: (replace(c, train=replace(c.train, recompute=True,
                                                       recompute_layers=r)), lo)

    blocks = cfg.model.n_layer // (layout.pp_size * layout.virtual_stages)
    groups = [
        [(f"zero={z}", zero(z)) for z in range(layout.zero_stage + 1, 4)]
        if layout.grad_replicas > 1 else [],
        [(f"offload.optimizer={f:g}", optimizer(f)) for f in OFFLOAD_FRACTIONS
         if f > cfg.offload.optimizer],
        [] if t.recompute and t.recompute_layers is None else
        [(f"train.recompute=true train.recompute_layers={r}", recompute(r))
         for r in range((t.recompute_layers or 0) + 1, blocks)]
        + [("train.recompute=true", recompute(None))],
        [] if cfg.offload.activations else [(ACTIVATIONS, None)]]  # its own search
    return [g for g in groups if g]


ACTIVATIONS = "offload.activations=true"  # with the fewest blocks that fit (cheapest_fit)


def offloadable_blocks(cfg: Config, layout: Layout) -> int:
    """The most blocks a chunk can offload: its blocks (the largest chunk) after the
    recomputed ones."""
    chunks = [len(b) for stage in layout.stage_blocks() for b in stage]
    return max(n - recomputed_layers(cfg, n) for n in chunks)


def fewest_offloaded_blocks(cfg: Config, layout: Layout, fits: Callable[[Plan], bool]
                            ) -> Optional[Tuple[Config, Plan]]:
    """`cfg` with activation offload of the fewest first blocks of each chunk
    (`offload.activations_layers`; None: every block, where only that fits) under which its
    plan `fits`, and that plan; None when even every block does not."""
    most = offloadable_blocks(cfg, layout)

    def with_blocks(k: int) -> Config:
        return replace(cfg, offload=replace(cfg.offload, activations=True,
                                            activations_layers=None if k >= most else k))
    if most < 1:
        return None
    full = make_plan(with_blocks(most), layout)
    if not fits(full):
        return None
    lo, hi, plan = 0, most, full  # fits(hi), not known at lo (k = 0 is no offload)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        candidate = make_plan(with_blocks(mid), layout)
        if fits(candidate):
            hi, plan = mid, candidate
        else:
            lo = mid
    return with_blocks(hi), plan


def cheapest_fit(cfg: Config, layout: Layout, device_bytes: float, profile: DeviceProfile,
                 gpus_per_node: int = 8) -> Optional[Suggestion]:
    """The placement change with the least added time (the time model's on `profile`, nodes
    of `gpus_per_node` ranks) under which every stage of `layout` plans at most
    `device_bytes` per rank (the module docstring); `overrides` empty when it fits already,
    None when no change or pair of changes (of different states) makes it fit."""
    base = make_plan(cfg, layout)
    per_node = min(gpus_per_node, layout.world_size)

    def fits(plan: Plan) -> bool:
        return all(s.bytes["total"] <= device_bytes for s in plan.stages)

    def host(plan: Plan) -> float:
        return max(s.host.get("total", 0.0) for s in plan.stages)

    if fits(base):
        return Suggestion((), 0.0, base.peak.bytes["total"], host(base))
    step = predict(cfg, layout, base.stages, profile, per_node).step_s
    best: Optional[Suggestion] = None
    groups = _changes(cfg, layout)
    for size in (1, 2):
        for chosen in itertools.combinations(groups, size):
            for picks in itertools.product(*chosen):
                changed, changed_layout = cfg, layout
                for text, apply in picks:
                    if text != ACTIVATIONS:
                        changed, changed_layout = apply(changed, changed_layout)
                if any(text == ACTIVATIONS for text, _ in picks):
                    found = fewest_offloaded_blocks(changed, changed_layout, fits)
                    if found is None:
                        continue
                    changed, plan = found
                else:
                    plan = make_plan(changed, changed_layout)
                    if not fits(plan):
                        continue
                added = max(0.0, predict(changed, changed_layout, plan.stages, profile,
                                         per_node).step_s - step)
                if best is None or added < best.added_s:
                    overrides = tuple(w for text, _ in picks for w in text.split())
                    k = changed.offload.activations_layers
                    if k is not None and changed.offload.activations and \
                            not cfg.offload.activations:
                        overrides += (f"offload.activations_layers={k}",)
                    best = Suggestion(overrides, added, plan.peak.bytes["total"], host(plan))
    return best
