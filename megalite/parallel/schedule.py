"""Pipeline schedules: which forward and backward each stage runs in which order, and which
point-to-point transfers go together (pure logic; `megalite.parallel.pipeline` executes it).

1F1B (Narayanan et al. 2021, "PipeDream-Flush"; Megatron-LM's non-interleaved schedule). With p
stages and m micro-batches, stage s runs

    warmup   = min(p - s - 1, m) forwards
    steady   = m - warmup times: one forward, then one backward (oldest micro-batch first)
    cooldown = warmup backwards

so at most p - s micro-batches have live activations on stage s (instead of m under GPipe), and
the idle "bubble" is (p - 1) / (m + p - 1) of the step when forward and backward times are equal.

Interleaved 1F1B (Narayanan et al. 2021 §2.2; Megatron-LM's virtual pipeline). Each rank holds
v model chunks: the model is cut into p·v virtual stages, and virtual stage c·p + s is chunk c
of rank s, so a micro-batch passes through every rank v times. Forwards run micro-batches in
groups of p: forward k is micro-batch (k // pv)·p + k % p on chunk (k // p) % v; backwards the
same with the chunks reversed. Warmup is (p - s - 1)·2 + (v - 1)·p forwards (Megatron's count).
Each pipeline fill and drain now costs 1/v of a full-model pass, so the bubble shrinks to
(p - 1) / (v·m + p - 1), for v times the point-to-point traffic and more activations in flight
during warmup. Needs m to be a multiple of p.

Transfers go in rounds. All stages' orders are simulated together with one time unit per
forward or backward: in round r each stage runs its next operation if its input arrived in an
earlier round, and what it produces is sent in round r's exchange, where the receiver posts the
matching receive. Every stage posts each round's sends and receives in one batch, in the order
the simulation lists them, so every send of a round meets its receive in the same round of the
peer: the exchanges cannot deadlock under any order, also with p = 2 where a rank's next and
previous stage are the same rank. The executor posts a round's batch without waiting and waits
for a transfer of round r only in a later round, when an operation consumes it; the peer posts
round r once its operation of round r ran, which only needed transfers of earlier rounds, so
by induction over the rounds every wait ends. A schedule whose orders cannot
complete is refused when it is planned, before any rank waits.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import lru_cache
from typing import List, Optional, Tuple

from megalite.layout import ChunkPlacement


class OpKind(str, enum.Enum):
    """What a pipeline operation computes. A forward consumes the previous slice's activation
    and sends its own to the next; a backward consumes the next slice's input gradient and
    sends its own to the previous: the kind of an operation also names what travels into it."""

    FORWARD = "F"
    BACKWARD = "B"

    @property
    def step(self) -> int:
        """Where its input comes from, in model slices (-1: the previous one)."""
        return -1 if self is OpKind.FORWARD else 1


F, B = OpKind.FORWARD, OpKind.BACKWARD


@dataclass(frozen=True)
class Op:
    kind: OpKind
    chunk: int  # model chunk on this rank (0 without interleaving)
    micro_batch: int


@dataclass(frozen=True)
class Transfer:
    """The input of a (kind, chunk, micro_batch) operation between ranks: an activation for a
    forward, a gradient for a backward."""

    kind: OpKind  # of the operation that consumes it
    src: int  # pipeline stage (rank in the pipeline group) that sends
    dst: int  # ... and that receives
    chunk: int  # the receiver's chunk that consumes it
    micro_batch: int


@dataclass
class Round:
    """What one stage does in one round: an operation (or nothing), then one exchange."""

    op: Optional[Op]
    index: int = 0  # the round's number in the whole pipeline's simulation
    sends: List[Transfer] = field(default_factory=list)
    recvs: List[Transfer] = field(default_factory=list)


def _check_groups(pp: int, m: int) -> None:
    if m % pp:
        raise ValueError(f"the interleaved schedule needs m={m} micro-batches to be a multiple "
                         f"of pp={pp}")


def stage_order(pp: int, stage: int, m: int, v: int = 1) -> List[Op]:
    """The operations of `stage`, in order: 1F1B for v = 1, interleaved 1F1B for v > 1."""
    if v == 1:
        warmup = min(pp - stage - 1, m)
        order = [Op(F, 0, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Op(F, 0, warmup + i), Op(B, 0, i)]
        return order + [Op(B, 0, i) for i in range(m - warmup, m)]
    _check_groups(pp, m)
    total = m * v

    def op(kind: OpKind, k: int) -> Op:
        chunk = (k % (pp * v)) // pp
        return Op(kind, chunk if kind is F else v - 1 - chunk, (k // (pp * v)) * pp + k % pp)

    warmup = min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    order = [op(F, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op(F, warmup + k), op(B, k)]
    return order + [op(B, k) for k in range(total - warmup, total)]


def _source(kind: OpKind, stage: int, chunk: int, placement: ChunkPlacement
            ) -> Optional[Tuple[int, int]]:
    """(stage, chunk) that produces the input of `kind` on (stage, chunk): the previous
    model slice's activation for a forward, the next one's gradient for a backward; None at
    the ends of the model (token ids in, loss out)."""
    return placement.neighbour(stage, chunk, kind.step)


def forward_order(pp: int, m: int, v: int = 1) -> List[Op]:
    """Forward-only (evaluation): the training order's forwards, in the same micro-batch groups."""
    if v > 1:
        _check_groups(pp, m)
    group = pp if v > 1 else m
    return [Op(F, (k % (group * v)) // group, (k // (group * v)) * group + k % group)
            for k in range(m * v)]


@lru_cache(maxsize=64)
def plan_rounds(pp: int, m: int, v: int = 1, forward_only: bool = False
                ) -> Tuple[Tuple[Round, ...], ...]:
    """Per stage, the rounds in which it computes or communicates (see the module docstring).
    Raises ValueError if the stages' orders cannot complete."""
    orders = [forward_order(pp, m, v) if forward_only else stage_order(pp, s, m, v)
              for s in range(pp)]
    placement = ChunkPlacement(pp, v)
    position = [0] * pp
    arrived = [set() for _ in range(pp)]  # (kind, chunk, micro_batch) inputs received
    rounds: List[List[Round]] = [[] for _ in range(pp)]
    index = 0
    while any(position[s] < len(orders[s]) for s in range(pp)):
        step = [Round(None, index) for _ in range(pp)]
        index += 1
        transfers: List[Transfer] = []
        for s in range(pp):
            if position[s] == len(orders[s]):
                continue
            op = orders[s][position[s]]
            src = _source(op.kind, s, op.chunk, placement)
            if src is not None and (op.kind, op.chunk, op.micro_batch) not in arrived[s]:
                continue
            step[s].op = op
            position[s] += 1
            out = placement.neighbour(s, op.chunk, -op.kind.step)
            if out is not None:  # the consumer of what this operation produces
                transfers.append(Transfer(op.kind, s, out[0], out[1], op.micro_batch))
        if not transfers and all(r.op is None for r in step):
            raise ValueError(f"pipeline schedule pp={pp} m={m} v={v} cannot complete: stages "
                             f"wait at {[orders[s][position[s]] for s in range(pp)]}")
        for t in transfers:
            step[t.src].sends.append(t)
            step[t.dst].recvs.append(t)
            arrived[t.dst].add((t.kind, t.chunk, t.micro_batch))
        for s in range(pp):
            if step[s].op is not None or step[s].sends or step[s].recvs:
                rounds[s].append(step[s])
    return tuple(tuple(r) for r in rounds)


def max_in_flight(pp: int, stage: int, m: int, v: int = 1) -> int:
    """Most (chunk, micro-batch) pairs whose activations `stage` holds at once."""
    return max(sum(counts) for counts in _live_peaks(pp, stage, m, v))


def peak_live_bytes(pp: int, stage: int, m: int, v: int, chunk_bytes: List[float]) -> float:
    """Most activation bytes `stage` holds at once, given each chunk's bytes per micro-batch."""
    return max(sum(n * b for n, b in zip(counts, chunk_bytes))
               for counts in _live_peaks(pp, stage, m, v))


@lru_cache(maxsize=4096)
def _live_peaks(pp: int, stage: int, m: int, v: int) -> Tuple[Tuple[int, ...], ...]:
    """The live (chunk, micro-batch) counts per chunk wherever `stage`'s order stops running
    forwards (a backward or the end follows): every peak of the live bytes is at one of them,
    whatever each chunk's bytes (cached: the planner's search asks for thousands of plans)."""
    live, peaks = [0] * v, set()
    order = stage_order(pp, stage, m, v)
    for i, op in enumerate(order):
        live[op.chunk] += 1 if op.kind is F else -1
        if op.kind is F and (i + 1 == len(order) or order[i + 1].kind is B):
            peaks.add(tuple(live))
    return tuple(sorted(peaks)) or ((0,) * v,)


def expected_bubble(pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step with equal forward and backward times per virtual stage:
    (p - 1) / (v·m + p - 1)."""
    return (pp - 1) / (v * m + pp - 1)

