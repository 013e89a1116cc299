"""The pipeline's step as its schedule runs it: each stage's operations in the order
`megalite.parallel.schedule.stage_order` gives them (1F1B, interleaved 1F1B, ZB-H1, ZB-V; any
number of micro-batches the schedule accepts, any blocks per stage), each started as soon as
its stage is free and its input has arrived: a forward waits for the previous model slice's
forward of the micro-batch, a backward (B) for the next slice's, plus the point-to-point
transfer between their stages (`hop_s[src][dst]`: zero on the same stage, as zb-v's turn);
a W follows its own B in the stage's order. The time model (`megalite.plan.time_model`)
charges the idle time this leaves on a stage as its bubble, what the transfers add as `pp`,
and times the data-parallel collectives against the first forwards and last backwards of
each chunk (`dp_windows`), not a closed formula: with unit times and no transfers the
simulation reproduces the schedules' formulas (`expected_bubble`: (p−1)/(v·m+p−1) for 1F1B
and interleaved, (p−1)/(3m+p−1) for ZB-H1, (p−1)/(6m+p−1) for ZB-V); with a heavier stage,
a costlier head or uneven blocks (`parallel.edge_stage_layers`) it gives the schedule's own
idle time, which no formula of p, m and v has.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

from megalite.config.stage_partition import ChunkPlacement
from megalite.parallel.schedule import B, F, Op, W, stage_order

Index = Tuple[int, int]  # (stage, position in its order)


@dataclass(frozen=True)
class OpTimes:
    """Seconds of one operation, per [stage][chunk]: a forward, a backward (the input
    gradient B under a split backward, else the whole backward) and a weight gradient W
    (zero-bubble schedules; unused otherwise)."""

    forward: Sequence[Sequence[float]]
    backward: Sequence[Sequence[float]]
    weight: Sequence[Sequence[float]]


@dataclass
class Timeline:
    """One simulated step: when it ends and, per stage, its busy seconds, the start and the
    duration of each chunk's first forward, and the start of each chunk's last backward
    operation (B, or W where the order has them: the last that makes its gradients)."""

    makespan: float
    busy: List[float]
    first_forward: List[Dict[int, Tuple[float, float]]]
    last_backward: List[Dict[int, float]]


@lru_cache(maxsize=64)
def _graph(pp: int, m: int, v: int, schedule: str
           ) -> Tuple[Tuple[Tuple[Op, ...], ...], Tuple[Tuple[Index, Optional[Index]], ...]]:
    """(per stage its order, every operation in an order that runs each after the one it
    waits for, with that one: (stage, position), producer or None). ValueError where the
    orders cannot complete."""
    orders = tuple(tuple(stage_order(pp, s, m, v, schedule)) for s in range(pp))
    placement = ChunkPlacement(pp, v, v_shape=schedule == "zb-v")
    where = [{(op.kind, op.chunk, op.micro_batch): i for i, op in enumerate(order)}
             for order in orders]

    def producer(s: int, op: Op) -> Optional[Index]:
        if op.kind is W:
            return None
        src = placement.neighbour(s, op.chunk, op.kind.step)
        return None if src is None else (src[0], where[src[0]][(op.kind, src[1],
                                                                 op.micro_batch)])
    position, done, out = [0] * pp, [0] * pp, []
    while len(out) < sum(map(len, orders)):
        progress = False
        for s in range(pp):
            while position[s] < len(orders[s]):
                dep = producer(s, orders[s][position[s]])
                if dep is not None and done[dep[0]] <= dep[1]:
                    break
                out.append(((s, position[s]), dep))
                position[s] += 1
                done[s] = position[s]
                progress = True
        if not progress:
            raise ValueError(f"pipeline schedule {schedule} pp={pp} m={m} v={v} cannot "
                             "complete")
    return orders, tuple(out)


def simulate(pp: int, m: int, v: int, schedule: str, times: OpTimes,
             hop_s: Optional[Sequence[Sequence[float]]] = None) -> Timeline:
    """The step of `schedule` with `times` per operation and `hop_s[src][dst]` seconds per
    transfer between stages (None: no transfer time)."""
    orders, graph = _graph(pp, m, v, schedule)
    per_kind = {F: times.forward, B: times.backward, W: times.weight}
    end = [[0.0] * len(order) for order in orders]
    first: List[Dict[int, Tuple[float, float]]] = [{} for _ in range(pp)]
    last: List[Dict[int, float]] = [{} for _ in range(pp)]
    busy = [0.0] * pp
    for (s, i), dep in graph:
        op = orders[s][i]
        duration = per_kind[op.kind][s][op.chunk]
        start = end[s][i - 1] if i else 0.0
        if dep is not None:
            hop = hop_s[dep[0]][s] if hop_s is not None else 0.0
            start = max(start, end[dep[0]][dep[1]] + hop)
        end[s][i] = start + duration
        busy[s] += duration
        if op.kind is F and op.chunk not in first[s]:
            first[s][op.chunk] = (start, duration)
        if op.kind is not F:
            last[s][op.chunk] = start
    return Timeline(max(e[-1] for e in end if e), busy, first, last)


def exposed_s(total_s: float, slots: Sequence[Tuple[float, float]]) -> float:
    """Seconds a stream of collectives taking `total_s` in all delays the step: `slots`
    (window seconds, share of `total_s` that must be done within it), `DpWindows`'."""
    return max([0.0] + [share * total_s - window for window, share in slots])


@dataclass(frozen=True)
class DpWindows:
    """What a stage's data-parallel collectives run against, as `exposed_s`'s slots.
    `reduce`: each chunk's gradient reduction may start at the start of its last backward
    operation (its buckets fill during it) and must end with the pipeline (the optimizer
    step waits for it); one stream runs them in that order, so the stream ends at
    max_i (ready_i + Σ_{j >= i} share_j · total): slot i is (end − ready_i, Σ_{j >= i}
    share_j). `gather`: ZeRO's parameter gather of each chunk runs from the step's start
    (after the optimizer step) in the order the chunks first run forward and must be done by
    the end of that first forward (the forward waits for its first bucket, later buckets
    gather under its compute): slot i is (first forward's end_i, Σ_{j <= i} share_j)."""

    reduce: Tuple[Tuple[float, float], ...]
    gather: Tuple[Tuple[float, float], ...]

    @classmethod
    def single(cls, t_f: float, t_b: float) -> "DpWindows":
        """No pipeline: the last micro-batch's backward, the first one's forward."""
        return cls(((t_b, 1.0),), ((t_f, 1.0),))


def dp_windows(timeline: Timeline, stage: int, shares: Sequence[float]) -> DpWindows:
    """`stage`'s windows on `timeline`; `shares`: each chunk's share of its parameters."""
    ready = sorted(timeline.last_backward[stage].items(), key=lambda kv: kv[1])
    reduce = tuple((timeline.makespan - start, sum(shares[c] for c, _ in ready[i:]))
                   for i, (_, start) in enumerate(ready))
    firsts = sorted(timeline.first_forward[stage].items(), key=lambda kv: kv[1][0])
    gather = tuple((start + duration, sum(shares[c] for c, _ in firsts[:i + 1]))
                   for i, (_, (start, duration)) in enumerate(firsts))
    return DpWindows(reduce, gather)
