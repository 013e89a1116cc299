"""ZeRO-3's all-gathers a step, unit by unit: a walk of one stage's pipeline operations in its
schedule's order (`megalite.parallel.schedule.stage_order`) that gathers and frees the units as
the runtime's hooks do (`megalite.parallel.zero3`, whose docstring has the rules):

    F   op starts: the unit held for it stops being held; then each unit of the chunk's chain,
        in forward order: gathered if not gathered, the next one prefetched (gathered); at the
        chunk's last unit the next operation's first unit is gathered and held; after its
        forward each unit but the last is freed (reshard_after_forward), unless it is in
        backward (under a zero-bubble schedule between its B and its W) or held
    B   op starts as F; each unit in backward order: gathered if not gathered, marked in
        backward, the previous one prefetched; at the chunk's first unit the next operation's
        first unit gathered and held; a unit whose gradients of the micro-batch are all in
        (its report: here, or under a zero-bubble schedule its W for a unit with a matmul's
        weight) leaves backward and is freed unless held
    W   the reports of the chunk's units whose weight gradients it computes; gathers nothing

A unit shared by two positions (the tied embedding, the LM head of a stage that holds both)
reports once per position's chunk and operation. Activation recomputation re-runs forwards
inside a backward on units already gathered (the backward hook comes first): no gathers;
offload.optimizer moves the prefetches from a unit's forward pre-hook to its post-hook, with
nothing freed in between: the same gathers. reshard_after_forward=false frees nothing until
the step's end: each unit once. The counts depend only on the schedule and the chains'
shapes, so they are cached: the layout search calls this for thousands of layouts.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, Optional, Set, Tuple

from megalite.parallel.schedule import SPLIT_BACKWARD, F, W, resolve_schedule, stage_order

# one chunk's chain: per position (unit id, whether a W reports it under a zero-bubble schedule)
Chain = Tuple[Tuple[int, bool], ...]


@lru_cache(maxsize=65536)
def unit_gathers(pp: int, stage: int, m: int, v: int, schedule: str, chains: Tuple[Chain, ...],
                 reshard: bool) -> Tuple[int, ...]:
    """All-gathers of each unit (by id, 0 .. max id) in one training step of `stage`."""
    split = resolve_schedule(schedule, v) in SPLIT_BACKWARD
    units = 1 + max((u for chain in chains for u, _ in chain), default=-1)
    walk = _Walk(units, reshard, _sources(chains, split))
    ops = stage_order(pp, stage, m, v, schedule)
    gathering = [op for op in ops if op.kind is not W]
    following = dict(zip(gathering, gathering[1:]))
    for op in ops:
        chain = [u for u, _ in chains[op.chunk]]
        if op.kind is W:
            walk.report(op.chunk, op.micro_batch, [u for u, w in chains[op.chunk] if w], True)
            continue
        nxt = following.get(op)
        walk.held = None
        ahead = None if nxt is None else \
            chains[nxt.chunk][0 if nxt.kind is F else -1][0]
        if op.kind is F:
            walk.forward(chain, ahead)
        else:
            walk.backward(op.chunk, op.micro_batch, chain, ahead,
                          [u for u, w in chains[op.chunk] if not (split and w)])
    return tuple(walk.gathers)


def _sources(chains: Tuple[Chain, ...], split: bool) -> Dict[int, Set[Tuple[int, bool]]]:
    """Per unit, the (chunk, in a W) operations that report its gradients each micro-batch."""
    out: Dict[int, Set[Tuple[int, bool]]] = {}
    for c, chain in enumerate(chains):
        for u, w in chain:
            out.setdefault(u, set()).add((c, split and w))
    return out


class _Walk:
    """The units' state through the walk: gathered (or in flight), in backward, held, and
    which operations reported each (unit, micro-batch)'s gradients so far."""

    def __init__(self, units: int, reshard: bool, sources: Dict[int, Set[Tuple[int, bool]]]):
        self.gathers = [0] * units
        self.gathered: Set[int] = set()
        self.in_backward: Set[int] = set()
        self.held: Optional[int] = None
        self.reshard = reshard
        self.sources = sources
        self.reported: Dict[Tuple[int, int], Set[Tuple[int, bool]]] = {}

    def gather(self, u: int) -> None:
        if u not in self.gathered:
            self.gathered.add(u)
            self.gathers[u] += 1

    def release(self, u: int) -> None:
        if u != self.held:
            self.gathered.discard(u)

    def hold(self, ahead: Optional[int]) -> None:
        if ahead is not None:
            self.gather(ahead)
            self.held = ahead

    def forward(self, chain: List[int], ahead: Optional[int]) -> None:
        for i, u in enumerate(chain):
            self.gather(u)
            if i + 1 < len(chain):
                self.gather(chain[i + 1])
            else:
                self.hold(ahead)
            if self.reshard and i + 1 < len(chain) and u not in self.in_backward:
                self.release(u)

    def backward(self, c: int, mb: int, chain: List[int], ahead: Optional[int],
                 reporting: List[int]) -> None:
        for i in reversed(range(len(chain))):
            u = chain[i]
            self.gather(u)
            self.in_backward.add(u)
            if i:
                self.gather(chain[i - 1])
            else:
                self.hold(ahead)
            if u in reporting and i == chain.index(u):  # its gradients in (once per chunk)
                self.report(c, mb, [u], False)

    def report(self, c: int, mb: int, units: List[int], in_w: bool) -> None:
        for u in units:
            got = self.reported.setdefault((u, mb), set())
            got.add((c, in_w))
            if got == self.sources[u]:
                del self.reported[(u, mb)]
                self.in_backward.discard(u)
                if self.reshard:
                    self.release(u)
