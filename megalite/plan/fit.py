"""The cheapest placement that makes a layout fit the device's memory: the plan names it next
to a stage that does not fit, and a planner's layout search can call it for each candidate.

`cheapest_fit(cfg, layout, device_bytes)` tries placement changes of the states the design
names (P, G, O, A: ZeRO sharding, offload, recompute), alone and in pairs, keeps those under
which every pipeline stage's planned total (`megalite.plan.memory.make_plan`) is at most
`device_bytes`, and returns the one with the smallest estimated added time per step. Pure: it
reads the configuration and plans, nothing else.

The candidates and what each is charged (per rank and step; `FitCosts` holds the rates):

    zero = z > current    the extra DP wire bytes of the plan (zero 2: m reduce-scatters;
                          zero 3: the parameter gathers) / dp_bytes_per_s
    offload.optimizer = f the plan's PCIe bytes / pcie_bytes_per_s + the host AdamW over
                          f·Ψ_o elements / host_adam_per_s (taken as not overlapped)
    recompute r blocks    the re-run forward: 2·(params per block)·tokens·r / flops
    offload.activations   the plan's activation PCIe bytes / pcie_bytes_per_s

Changing tp, pp, dp or the micro-batch size changes the layout itself: that is the search's
business, not a placement.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.plan.memory import Plan, make_plan
from megalite.plan.offload import owned_elements

OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class FitCosts:
    """Rates the added time of a placement is estimated with (defaults: an H100 node on a
    200 Gb/s network; a planner with measured rates passes its own)."""

    flops: float = 400e12  # achieved FLOP/s per device (~40% of the H100's bf16 peak)
    dp_bytes_per_s: float = 25e9  # DP wire bytes per second per rank
    pcie_bytes_per_s: float = 25e9  # host <-> device per direction
    host_adam_per_s: float = 1e9  # host AdamW parameter updates per second per rank


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


def _added_seconds(cfg: Config, layout: Layout, base: Plan, plan: Plan,
                   costs: FitCosts) -> float:
    """The estimate of the module docstring, for the busiest stage."""
    t, m = cfg.train, plan.layout["micro_batches"]
    worst = 0.0
    for old, new in zip(base.stages, plan.stages):
        pcie = sum(new.pcie.values()) - sum(old.pcie.values())
        adam = (cfg.offload.optimizer - base.layout.get("offload_optimizer", 0.0)) \
            * owned_elements(layout, new.params) / costs.host_adam_per_s
        rerun = _recomputed(cfg, new.layers) - _recomputed_base(base, new.layers)
        block_params = 12 * cfg.model.n_embd ** 2 / layout.tp_size
        flops = 2 * block_params * t.seq_len * t.micro_batch_size * m * rerun
        # each term >= 0: a change that happens to send less (zero 1's bf16 all-gather
        # instead of zero 0's fp32 all-reduce) must not pay for another
        worst = max(worst, max(0.0, new.comm["dp"] - old.comm["dp"]) / costs.dp_bytes_per_s
                    + max(0.0, pcie) / costs.pcie_bytes_per_s + max(0.0, adam)
                    + max(0.0, flops) / costs.flops)
    return worst


def _recomputed(cfg: Config, layers: int) -> int:
    if not cfg.train.recompute:
        return 0
    return layers if cfg.train.recompute_layers is None else min(cfg.train.recompute_layers,
                                                                 layers)


def _recomputed_base(plan: Plan, layers: int) -> int:
    lay = plan.layout
    if not lay["recompute"]:
        return 0
    return layers if lay["recompute_layers"] is None else min(lay["recompute_layers"], layers)


def cheapest_fit(cfg: Config, layout: Layout, device_bytes: float,
                 costs: FitCosts = FitCosts()) -> Optional[Suggestion]:
    """The placement change with the least added time under which every stage of `layout`
    plans at most `device_bytes` per rank (the module docstring); `overrides` empty when it
    fits already, None when no change or pair of changes (of different states) makes it fit."""
    base = make_plan(cfg, layout)

    def fits(plan: Plan) -> bool:
        return all(s.bytes["total"] <= device_bytes for s in plan.stages)

    def host(plan: Plan) -> float:
        return max(s.host.get("total", 0.0) for s in plan.stages)

    if fits(base):
        return Suggestion((), 0.0, base.peak.bytes["total"], host(base))
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
                added = _added_seconds(changed, changed_layout, base, plan, costs)
                if best is None or added < best.added_s:
                    overrides = tuple(w for text, _ in picks for w in text.split())
                    best = Suggestion(overrides, added, plan.peak.bytes["total"], host(plan))
    return best
