"""Who is to blame for a suspicious step: the pure decisions of `megalite.resilience.rerun`,
from the tables of every rank's local results.

A rank's *local results* of one execution of a step are three numbers, each computed from
what the rank itself computed:

    loss         its mean loss over its micro-batches (the last pipeline stage; 0 elsewhere)
    grad_local   the squared norm of its local gradient *before* the data-parallel
                 reduction (what its own backward produced; an fp32 norm per bucket)
    grad_reduced the sum of squares of its owned range of the reduced gradient

A faulty rank's forward changes its loss (and its gradient); a faulty backward changes its
local gradient; neither touches another DP replica's loss or local gradient. The reduction
then spreads any of them to every DP replica's reduced gradient, which is why `grad_reduced`
only names a rank when nothing earlier differs (a fault after the reduction). Under tensor
and pipeline parallelism a fault also spreads through the activations to the rank's
model-parallel peers of the same replica, whose local results then differ too: they are
named with it. Under expert parallelism it spreads through the token exchange to the rank's
EP peers, which may be other replicas' ranks (their tokens ran through its experts, its
tokens through theirs): the replicas an EP group joins form one *domain*
(`replica_domains`), which takes the place of a replica in the verdicts.
"""
from __future__ import annotations

import math
from typing import List, Sequence

RESULTS = ("loss", "grad_local", "grad_reduced")
LOCAL = 2  # the first two results are the rank's own computation; the last is shared by DP


def agree(a: float, b: float, tolerance: float) -> bool:
    """Two executions' values agree: bitwise (tolerance 0) or within a relative tolerance;
    NaN agrees with NaN (the same fault reproduced), and an infinity with itself."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if a == b:
        return True
    if math.isinf(a) or math.isinf(b):  # an infinity agrees with itself only
        return False
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def differing(a: Sequence[float], b: Sequence[float], tolerance: float) -> List[int]:
    """Indices of the results that disagree."""
    return [i for i, (x, y) in enumerate(zip(a, b)) if not agree(x, y, tolerance)]


def transient_suspects(first: Sequence[Sequence[float]], second: Sequence[Sequence[float]],
                       tolerance: float) -> List[int]:
    """The ranks to blame when re-executing the step changed something: those whose own
    computation (loss, local gradient) changed; failing that, those whose reduced gradient
    did. `first[r]`, `second[r]`: rank r's local results of the two executions. Empty when
    the two executions agree everywhere."""
    own = own_changes(first, second, tolerance)
    return own or [r for r, (a, b) in enumerate(zip(first, second))
                   if differing(a, b, tolerance)]


def own_changes(first: Sequence[Sequence[float]], second: Sequence[Sequence[float]],
                tolerance: float) -> List[int]:
    """The ranks whose own computation (loss, local gradient) changed between two
    executions."""
    return [r for r, (a, b) in enumerate(zip(first, second))
            if differing(a[:LOCAL], b[:LOCAL], tolerance)]


def replica_domains(tp: int, pp: int, dp: int, ep: int = 1) -> List[List[int]]:
    """The global ranks of each *domain*: the DP replicas that a fault can reach through the
    activations, each in the same model-parallel order (rank = tp_rank + tp · (pp_rank + pp ·
    dp_rank), cp = 1). Without expert parallelism a domain is one replica. With ep > 1 each
    pipeline stage's EP groups exchange tokens over ep consecutive ranks of the stage's
    tp·dp (`megalite.parallel.topology`), so a rank's experts compute for, and its faults
    reach, every replica of its EP group: a domain is lcm(ep, tp) / tp consecutive replicas
    (one run of EP groups and replicas that ends where both end), the whole world when ep
    spans every replica. Two domains never exchange an activation, and the j-th ranks of two
    domains hold the same dense parameters and the same experts."""
    k = math.lcm(ep, tp) // tp  # replicas per domain
    mp = tp * pp
    return [[r * mp + j for r in range(d * k, (d + 1) * k) for j in range(mp)]
            for d in range(dp // k)]


def nondeterministic(changed: Sequence[int], replicas: Sequence[Sequence[int]],
                     shards_parameters: bool = False) -> bool:
    """Whether the ranks whose own results changed on re-execution (`changed`) lie in two or
    more domains (`replicas[d]`: domain d's global ranks, `replica_domains`: a DP replica
    without expert parallelism). A faulty device changes its own results and those of its
    model-parallel peers and EP peers (through the activations), never another domain's loss
    or local gradient (computed from that domain's data with the same parameters, before any
    reduction): changes in several domains at once are the kernels' non-determinism
    (atomics in the backward, most often), not a fault on all of them. Two faults at once on
    two domains would read the same: called non-determinism, and logged.
    With one domain (dp = 1, or ep spanning every replica) a fault changes every rank's
    results too, and this cannot tell;
    deterministic kernels and resilience.rerun_tolerance are the protection there. Nor under
    ZeRO-3 (`shards_parameters`): every forward gathers every replica's parameter shard, so a
    device that corrupts its shard or its send changes every replica's results; the rule is
    off there and such a step goes on to the transient / persistent verdicts."""
    if shards_parameters:
        return False
    touched = {d for d, ranks in enumerate(replicas) if set(ranks) & set(changed)}
    return len(touched) >= 2


def cross_replica_verdict(first: Sequence[Sequence[float]], recomputed: Sequence[Sequence[float]],
                          replicas: Sequence[Sequence[int]], tolerance: float) -> List[int]:
    """After a re-execution reproduced the suspicious step: domain d + 1 recomputed domain
    d's micro-batches (same parameters and random streams; `recomputed[r]`: rank r's local
    results of that recomputation, `first[r]` of its original execution). `replicas[d]`: the
    global ranks of domain d (`replica_domains`: a DP replica without expert parallelism), in
    the same model-parallel order for every d. Under EP the j-th rank of domain d + 1 holds
    the experts of domain d's j-th and receives the same tokens from the same EP positions,
    so its local gradient, experts' included, is the one d's j-th computed.

    Returns the ranks of a persistent fault, or [] when every replica's micro-batches gave
    the same results on their neighbour: then the data is the cause. A faulty replica F
    disagrees in both pairs it takes part in (its own data recomputed by F + 1, and F - 1's
    data recomputed by F). With two replicas both replicas are in both pairs: the one whose
    computations of both data sets are non-finite while the other's are finite is the faulty
    one; when that does not single one out, both are named."""
    n = len(replicas)

    def pair_differs(d: int) -> List[int]:  # ranks of replica d whose data disagreed
        nxt = replicas[(d + 1) % n]
        return [r for j, r in enumerate(replicas[d])
                if differing(first[r][:LOCAL], recomputed[nxt[j]][:LOCAL], tolerance)]

    bad_pairs = {d: pair_differs(d) for d in range(n)}
    if not any(bad_pairs.values()):
        return []
    candidates = [d for d in range(n) if bad_pairs[d] and bad_pairs[(d - 1) % n]]
    if len(candidates) > 1:
        broken = [d for d in candidates
                  if _non_finite(first, replicas[d]) and _non_finite(recomputed, replicas[d])]
        if len(broken) == 1:
            candidates = broken
    if not candidates:  # one disagreeing pair and no replica in two: blame the pair's owner
        candidates = [d for d in range(n) if bad_pairs[d]]
    suspects: List[int] = []
    for d in candidates:
        prev = replicas[(d - 1) % n]
        named = set(bad_pairs[d]) | {replicas[d][j] for j, r in enumerate(prev)
                                     if r in bad_pairs[(d - 1) % n]}
        suspects += sorted(named) or list(replicas[d])
    return sorted(set(suspects))


def _non_finite(table: Sequence[Sequence[float]], ranks: Sequence[int]) -> bool:
    return any(not math.isfinite(v) for r in ranks for v in table[r][:LOCAL])
