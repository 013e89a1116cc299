"""The collective-order probe: NCCL's rule, checked on gloo ranks.

NCCL does not promise progress when two ranks issue operations on different communicators in
different orders (its guide: issue them in the same order on every rank; with
`CUDA_DEVICE_MAX_CONNECTIONS=1` a mismatch hangs). gloo forgives it, so a CPU run that passes
proves nothing about the order. The probe records, on each rank, every operation the rank
*launches* on its groups — the order of enqueueing is what NCCL sees; waits do not matter —
and `order_mismatches` holds the ranks to the rule:

    for every two ranks a and b, the operations a launched on the groups that hold b (and its
    point-to-point batches with b) form the same sequence, in launch order, as the operations
    b launched on the groups that hold a (and its batches with a).

`megalite.parallel.calls` reports every launch to the slot `CommCounter.flight` (the hang
watch's flight recorder); the probe takes that slot, records the launch and passes every
report on to the recorder that was there, if any. A later feature's new collective (the MoE
all-to-all) is probed as soon as it goes through `megalite.parallel.comm`.

    probe = OrderProbe.install(trainer.topo.counter)   # in each rank, before the steps
    ...                                                # train
    problems = order_mismatches([sequences of every rank, by global rank])
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Set, Tuple

# (group name, the group's global ranks, op, peers of a point-to-point batch or None)
Launch = Tuple[str, Tuple[int, ...], str, Optional[Tuple[int, ...]]]


class OrderProbe:
    """One rank's launches, in order (`launched`), recorded from the counter's flight slot."""

    def __init__(self, inner=None):
        self.inner = inner  # the flight recorder the probe stands in front of, or None
        self.launched: List[Launch] = []

    @classmethod
    def install(cls, counter) -> "OrderProbe":
        """Put a probe in front of `counter`'s flight recorder (a `CommCounter`)."""
        probe = cls(counter.flight)
        counter.flight = probe
        return probe

    def started(self, op: str, group, nbytes: int, peers=None, arrival=None):
        self.launched.append((group.name, tuple(group.ranks), op,
                              None if peers is None else tuple(sorted(peers))))
        if self.inner is None:
            return None
        return self.inner.started(op, group, nbytes, peers=peers, arrival=arrival)

    def failed(self, entry, description: str, error: BaseException) -> None:
        if self.inner is not None:
            self.inner.failed(entry, description, error)

    def __getattr__(self, name):
        """The recorder's other reports (`waiting`, `done`, ... on an entry it made) and
        reads (`poll`, `snapshot`) go to it; without one, reports on no entry do nothing."""
        inner = self.__dict__.get("inner")
        if inner is not None:
            return getattr(inner, name)
        return lambda *args, **kwargs: None


def _seen_with(launched: Sequence[Launch], me: int, other: int) -> List[Tuple[str, str]]:
    """`me`'s launches that `other` takes part in: collectives on groups holding `other`,
    point-to-point batches with `other` among the peers."""
    out = []
    for name, ranks, op, peers in launched:
        if (other in peers) if peers is not None else (other in ranks and me in ranks):
            out.append((name, op))
    return out


def _steps(launched: Sequence[Launch], me: int) -> List[List[tuple]]:
    """`me`'s launches as events every rank taking part names alike: a collective is (its
    group, its index on the group), a point-to-point batch one event per peer (the pair, its
    index between them on the group; the events of one batch are launched together)."""
    seen: Dict[tuple, int] = defaultdict(int)
    steps = []
    for name, ranks, op, peers in launched:
        keys = [(name, ranks)] if peers is None else \
            [(name, ranks, min(me, p), max(me, p)) for p in peers]
        step = []
        for key in keys:
            step.append((*key, seen[key]))
            seen[key] += 1
        steps.append(step)
    return steps


def order_cycle(sequences: Sequence[Sequence[Launch]]) -> List[tuple]:
    """A cycle of launches that wait for each other, or [] where none. Each rank launches its
    events in order, so event x before event y on some rank is an edge x -> y; every rank
    taking part in an event must reach it, so a cycle (A: g1 then g2, B: g2 then g3, C: g3
    then g1 — every two ranks agree, all three wait) is a hang under NCCL's rule."""
    edges: Dict[tuple, Set[tuple]] = defaultdict(set)
    nodes: Set[tuple] = set()
    for r, launched in enumerate(sequences):
        steps = _steps(launched, r)
        for step in steps:
            nodes.update(step)
        for before, after in zip(steps, steps[1:]):
            for x in before:
                edges[x].update(after)
    indegree = {n: 0 for n in nodes}
    for x in nodes:
        for y in edges[x]:
            indegree[y] += 1
    ready = [n for n, d in indegree.items() if d == 0]
    while ready:
        for y in edges[ready.pop()]:
            indegree[y] -= 1
            if indegree[y] == 0:
                ready.append(y)
    left = {n for n, d in indegree.items() if d > 0}
    if not left:
        return []
    # every event left waits for another one left: walk back until one repeats
    before = {y: x for x in left for y in edges[x] if y in left}
    path, at = [], next(iter(left))
    while at not in path:
        path.append(at)
        at = before[at]
    return path[path.index(at):][::-1]


def order_mismatches(sequences: Sequence[Sequence[Launch]], limit: int = 5) -> List[str]:
    """Every pair of ranks whose shared launches differ in order (at most `limit` pairs), each
    with the first position where they part and a few launches either side; and a cycle of
    launches waiting for each other across three or more ranks (`order_cycle`)."""
    cycle = order_cycle(sequences)
    problems = [f"a cycle of launches waits for itself: {cycle[:6]}"] if cycle else []
    for a in range(len(sequences)):
        for b in range(a + 1, len(sequences)):
            mine, theirs = _seen_with(sequences[a], a, b), _seen_with(sequences[b], b, a)
            if mine == theirs:
                continue
            at = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y),
                      min(len(mine), len(theirs)))
            problems.append(
                f"ranks {a} and {b} part at their shared launch {at} "
                f"({len(mine)} and {len(theirs)} in all): rank {a} {mine[max(0, at - 2):at + 3]}"
                f", rank {b} {theirs[max(0, at - 2):at + 3]}")
            if len(problems) >= limit:
                return problems
    return problems
