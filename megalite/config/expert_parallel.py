"""The `ep` key (expert parallelism) checked before launch: the experts of every MoE layer are
split over ep ranks folded over a pipeline stage's tp·cp·dp ranks (`megalite.parallel.
topology`; docs/moe.md). What EP does not run with yet is refused here, each by its key; the
support matrix lists these refusals."""
from __future__ import annotations

import math

from megalite.config.errors import fail


def check_expert_parallel(cfg, world_size: int) -> None:
    """`cfg.ep` against the model, the world size (already checked to be tp·cp·pp·dp) and
    the other keys (ConfigError naming the first key that does not fit)."""
    ep, moe = cfg.ep, cfg.model.moe
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        fail("ep", ep, "must be a positive integer (1: every rank holds every expert)")
    if ep == 1:
        return
    if not moe.enabled:
        fail("ep", ep, f"splits the experts of MoE layers, and model.arch={cfg.model.arch} with "
             f"model.moe.num_experts={moe.num_experts} has none; use ep=1")
    stage = world_size // cfg.pp  # the tp·cp·dp ranks of one pipeline stage
    good = _divisor(math.gcd(stage, moe.num_experts), ep)
    if stage % ep:
        fail("ep", ep, f"must divide the tp*cp*dp = {stage} ranks of a pipeline stage "
             f"(world size {world_size} / pp={cfg.pp}); e.g. ep={good}")
    if moe.num_experts % ep:
        fail("ep", ep, f"must divide model.moe.num_experts={moe.num_experts} (each EP rank "
             f"holds num_experts/ep experts); e.g. ep={good}")
    why = f"is not supported with ep={ep} (expert parallelism) yet"
    if cfg.fp8.recipe == "rowwise":  # tensorwise runs: megalite.model.moe.fp8_sources
        fail("fp8.recipe", "rowwise", f"{why}: the routed experts' FP8 is tensorwise (one "
             "scale per expert and micro-batch, each source's rows scaled with its own "
             "micro-batch's); MoE refuses rowwise whatever ep; use fp8.recipe=tensorwise or "
             "none")


def _divisor(n: int, near: int) -> int:
    """The largest divisor of `n` not above `near`."""
    return max(d for d in range(1, min(n, near) + 1) if n % d == 0)
