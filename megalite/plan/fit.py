"""The cheapest placement that makes a layout fit the device's memory: the plan names it next
to a stage that does not fit, and a planner's layout search can call it for each candidate.

`cheapest_fit(cfg, layout, device_bytes, profile)` tries placement changes of the states the design
names (P, G, O, A: ZeRO sharding, offload, recompute), alone and in pairs, keeps those under
which every pipeline stage's planned total (`megalite.plan.memory.make_plan`) is at most
`device_bytes`, and returns the one with the smallest estimated added time per step. Pure: it
reads the configuration and plans, nothing else.

The added time of a candidate is the time model's (`megalite.plan.time_model.predict`, on the
caller's device profile): its predicted step less the layout's, so a placement is charged as
the planner charges it everywhere — ZeRO's extra DP traffic beyond what the backward hides,
offload.optimizer's gradient and parameter copies at the profile's pinned copy rates and its
host step at the profile's host AdamW rate, recompute's re-run forward (FLOPs and its blocks'
non-matmul time), activation offload's copies beyond the compute they overlap. There is one
offload cost model, the time model's; nothing here has rates of its own.

Changing tp, pp, dp or the micro-batch size changes the layout itself: that is the search's
business, not a placement.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.plan.devices import DeviceProfile
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


Change = Tuple[str, Callable[[Config, Layout], Tuple[Config, Layout]]]


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

    def activations(c, lo):
        return replace(c, offload=replace(c.offload, activations=True)), lo

    blocks = cfg.model.n_layer // (layout.pp_size * layout.virtual_stages)
    groups = [
        [(f"zero={z}", zero(z)) for z in range(layout.zero_stage + 1, 4)]
        if layout.dp_size > 1 else [],
        [(f"offload.optimizer={f:g}", optimizer(f)) for f in OFFLOAD_FRACTIONS
         if f > cfg.offload.optimizer],
        [] if t.recompute and t.recompute_layers is None else
        [(f"train.recompute=true train.recompute_layers={r}", recompute(r))
         for r in range((t.recompute_layers or 0) + 1, blocks)]
        + [("train.recompute=true", recompute(None))],
        [] if cfg.offload.activations else [("offload.activations=true", activations)]]
    return [g for g in groups if g]


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
                for _, apply in picks:
                    changed, changed_layout = apply(changed, changed_layout)
                plan = make_plan(changed, changed_layout)
                if not fits(plan):
                    continue
                added = max(0.0, predict(changed, changed_layout, plan.stages, profile,
                                         per_node).step_s - step)
                if best is None or added < best.added_s:
                    overrides = tuple(w for text, _ in picks for w in text.split())
                    best = Suggestion(overrides, added, plan.peak.bytes["total"], host(plan))
    return best
