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
of rank s, so a micro-batch passes through every rank v times. Forwards run the micro-batches
in groups (`interleaved_table`): a group's micro-batches on chunk 0, then the same ones on
chunk 1, ..., then the next group; backwards the same with the chunks reversed. The groups hold
p micro-batches and the last one the rest (p to 2p - 1), so any m >= p runs — the flexible
schedule of Llama 3 (Dubey et al. 2024 §3.3.2, Figure 6). Warmup is (p - s - 1)·2 + (v - 1)·g
forwards, g the largest group (`largest_group`; Megatron's count with its
`microbatch_group_size_per_vp_stage` = g): the last stage's first backward of a group on chunk
v - 1 needs that group's forward on chunk v - 1, (v - 1)·g forwards after the group's first.
Each pipeline fill and drain now costs 1/v of a full-model pass, so with equal forward and
backward times a step takes 2·v·m + 2(p - 1) rounds for every m >= p: the bubble is
(p - 1) / (v·m + p - 1), for v times the point-to-point traffic and more activations in flight
during warmup: at most (p - s - 1)·2 + (v - 1)·g + 1 chunk micro-batches on stage s, so an m
that is not a multiple of p costs (v - 1)·(m mod p) more chunk activations than a multiple of
p. Megatron's table instead leaves m mod p as a last group of its own with the warmup of p:
the activations of a multiple of p, but the short group returns to stage 0 before stage 0 has
work (idle rounds more per step: pp 4, v 2, m 6: 6; pp 4, v 3, m 6: 12),
and these matched rounds cannot complete its order for some m (pp 4, v 3, m 5).

ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1, the handcrafted schedule of
Figure 3, top). Each backward is split into B, the input gradient (what the previous stage waits
for), and W, the weight gradient (what only the optimizer needs; `megalite.parallel.weight_grad`).
Stage s runs 1F1B's forwards and B's in 1F1B's order — removing the W's gives 1F1B exactly, so
it holds full activations of at most p - s micro-batches — and runs W(i) right after B(i + s)
in the steady phase and after each cooldown B, the rest at the end: later stages postpone up to
s W's into the slots where 1F1B's cooldown idles. A micro-batch holds activations (those W
needs, after B) from its F to its W, on at most p stages' worth at once: 1F1B's peak (stage 0's
p). With unit times F = B = W (1F1B's backward = B + W = 2), m >= p: a step takes 3m + p - 1
units, the bubble is (p - 1) / (3m + p - 1), a third of 1F1B's (p - 1)(F + B + W) idle units per
stage; with m < p the pipeline cannot fill and a step takes 2m + 2p - 1.

ZB-V (Qi et al. 2024 §6; `zb_v_order`, the construction of torch's ScheduleZBVZeroBubble): two
chunks per rank in a V — rank s holds model slices s and 2p - 1 - s (`ChunkPlacement(v_shape=
True)`), so rank 0 holds both the embedding and the LM head. With unit times per chunk
operation a step takes 6m + p - 1 units for m >= (3p - 1) / 2 (bubble (p - 1) / (6m + p - 1),
half of ZB-H1's in stage time), with at most 2p chunk activations (p micro-batches of a whole
stage: 1F1B's peak) in flight. Rank 0 computes the loss; rank p - 1 hands its chunk 0's
activation to its own chunk 1 (and the gradient back) without the network: the rounds list
such a transfer as `local`, arriving, like a sent one, for the next round.

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

from megalite.config.schedule_rules import resolve_schedule
from megalite.config.stage_partition import ChunkPlacement


class OpKind(str, enum.Enum):
    """What a pipeline operation computes. A forward consumes the previous slice's activation
    and sends its own to the next; a backward consumes the next slice's input gradient and
    sends its own to the previous: the kind of an operation also names what travels into it."""

    FORWARD = "F"
    BACKWARD = "B"  # the whole backward, or under a zero-bubble schedule its input gradient
    WEIGHT = "W"  # zero-bubble schedules: the weight gradient, deferred (no transfer)

    @property
    def step(self) -> Optional[int]:
        """Where its input comes from, in model slices (-1: the previous one); None: from this
        stage itself (W reads what its B kept)."""
        return {"F": -1, "B": 1}.get(self.value)


F, B, W = OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT

SPLIT_BACKWARD = ("zb-h1", "zb-v")  # schedules that run B and W apart


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
    local: List[Transfer] = field(default_factory=list)  # to this stage's other chunk (the
    #                                     V's turn: zb-v's slices p-1 and p on stage p-1)


def largest_group(pp: int, m: int) -> int:
    """Micro-batches in the interleaved schedule's largest group (`interleaved_table`): pp
    when m is a multiple of pp, else the last group's pp + m mod pp (m when m < 2·pp)."""
    return m if m < 2 * pp else pp + m % pp


def interleaved_table(pp: int, m: int, v: int) -> List[Tuple[int, int]]:
    """(micro-batch, chunk) of each of the interleaved schedule's v·m forwards, in order (its
    backwards run the same list with chunk c as v - 1 - c): groups of pp micro-batches, the
    last one taking the rest (pp to 2·pp - 1 of them; all m when m < pp), each group through
    chunk 0, then chunk 1, ... (see the module docstring)."""
    starts = list(range(0, m, pp))
    if len(starts) > 1 and m - starts[-1] < pp:
        starts.pop()  # the remainder joins the last full group
    ends = starts[1:] + [m]
    return [(i, c) for start, end in zip(starts, ends) for c in range(v)
            for i in range(start, end)]


def zb_h1_order(pp: int, stage: int, m: int) -> List[Op]:
    """ZB-H1's operations of `stage` (see the module docstring)."""
    warmup = min(pp - stage - 1, m)
    order = [Op(F, 0, i) for i in range(warmup)]
    weights = 0  # W's run so far (oldest micro-batch first)
    for i in range(m - warmup):
        order += [Op(F, 0, warmup + i), Op(B, 0, i)]
        if i >= stage:  # stage s postpones s W's
            order.append(Op(W, 0, weights))
            weights += 1
    for i in range(m - warmup, m):
        order += [Op(B, 0, i), Op(W, 0, weights)]
        weights += 1
    return order + [Op(W, 0, i) for i in range(weights, m)]


def zb_v_order(pp: int, stage: int, m: int) -> List[Op]:
    """ZB-V's operations of `stage` (Qi et al. 2024 §6; the construction of
    torch.distributed.pipelining's ScheduleZBVZeroBubble): chunk 0 is model slice s, chunk 1
    slice 2p - 1 - s (the V placement). Built for max(m, 2p - 1) micro-batches, keeping those
    below m (the pipeline needs 2p - 1 to fill)."""
    n = max(2 * pp - 1, m)
    order: List[Op] = []
    count = {(k, c): 0 for k in (F, B, W) for c in (0, 1)}

    def run(kind: OpKind, chunk: int, micro_batch: Optional[int] = None) -> None:
        i = count[(kind, chunk)] if micro_batch is None else micro_batch
        count[(kind, chunk)] += micro_batch is None
        order.append(Op(kind, chunk, i))

    for _ in range(2 * (pp - stage) - 1):
        run(F, 0)
    for _ in range(stage):
        run(F, 1)
        run(F, 0)
    for _ in range(pp - stage):
        run(F, 1)
        run(B, 1)
        run(W, 1)
    while count[(F, 1)] < count[(F, 0)] or count[(F, 0)] < n:
        if count[(F, 0)] < n:
            run(F, 0)
        run(B, 0)
        run(W, 0)
        run(F, 1)
        run(B, 1)
        run(W, 1)
    for _ in range(stage):
        run(B, 0)
        run(B, 1)
    for _ in range(pp - stage):
        run(B, 0)
        run(W, 0)
    for chunk in (1, 0):
        while count[(W, chunk)] < count[(B, chunk)]:
            run(W, chunk)
    return [op for op in order if op.micro_batch < m]


def stage_order(pp: int, stage: int, m: int, v: int = 1, schedule: str = "auto") -> List[Op]:
    """The operations of `stage`, in order: 1F1B for v = 1, interleaved 1F1B for v > 1 (auto),
    or the named schedule."""
    schedule = resolve_schedule(schedule, v)
    if schedule == "zb-h1":
        if v != 1:
            raise ValueError(f"zb-h1 runs one chunk per stage, not virtual_stages={v}")
        return zb_h1_order(pp, stage, m)
    if schedule == "zb-v":
        if v != 2:
            raise ValueError(f"zb-v runs two chunks per stage, not virtual_stages={v}")
        return zb_v_order(pp, stage, m)
    if (schedule == "interleaved") != (v > 1):
        raise ValueError(f"schedule {schedule} cannot run virtual_stages={v}")
    if v == 1:
        warmup = min(pp - stage - 1, m)
        order = [Op(F, 0, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Op(F, 0, warmup + i), Op(B, 0, i)]
        return order + [Op(B, 0, i) for i in range(m - warmup, m)]
    if m < pp:
        raise ValueError(f"the interleaved schedule needs m >= pp micro-batches (m={m}, "
                         f"pp={pp})")
    table, total = interleaved_table(pp, m, v), m * v

    def op(kind: OpKind, k: int) -> Op:
        micro_batch, chunk = table[k]
        return Op(kind, chunk if kind is F else v - 1 - chunk, micro_batch)

    warmup = min((pp - stage - 1) * 2 + (v - 1) * largest_group(pp, m), total)
    order = [op(F, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op(F, warmup + k), op(B, k)]
    return order + [op(B, k) for k in range(total - warmup, total)]


def input_source(kind: OpKind, stage: int, chunk: int, placement: ChunkPlacement
                 ) -> Optional[Tuple[int, int]]:
    """(stage, chunk) that produces the input of `kind` on (stage, chunk): the previous
    model slice's activation for a forward, the next one's gradient for a backward; None at
    the ends of the model (token ids in, loss out) and for a W (its B ran on this stage).
    With `stage_order` this is the schedule's whole dependency graph: an operation waits for
    the one before it on its stage and for the same micro-batch's operation of this kind on
    the source (a time model weights each by its stage's own blocks)."""
    return None if kind.step is None else placement.neighbour(stage, chunk, kind.step)


def forward_order(pp: int, m: int, v: int = 1, schedule: str = "auto") -> List[Op]:
    """Forward-only (evaluation): the interleaved training order's forwards, in the same
    micro-batch groups (any m: with m < pp one group); otherwise every micro-batch's chunk 0,
    then chunk 1, ... (zb-v: a forward-only pass keeps no activations, so the V needs no
    groups)."""
    grouped = v > 1 and resolve_schedule(schedule, v) == "interleaved"
    return [Op(F, c, i) for i, c in interleaved_table(pp if grouped else m, m, v)]


@lru_cache(maxsize=64)
def plan_rounds(pp: int, m: int, v: int = 1, forward_only: bool = False,
                schedule: str = "auto") -> Tuple[Tuple[Round, ...], ...]:
    """Per stage, the rounds in which it computes or communicates (see the module docstring).
    Raises ValueError if the stages' orders cannot complete."""
    orders = [forward_order(pp, m, v, schedule) if forward_only
              else stage_order(pp, s, m, v, schedule)
              for s in range(pp)]
    placement = ChunkPlacement(pp, v, v_shape=schedule == "zb-v")
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
            src = input_source(op.kind, s, op.chunk, placement)
            if src is not None and (op.kind, op.chunk, op.micro_batch) not in arrived[s]:
                continue
            step[s].op = op
            position[s] += 1
            out = None if op.kind is W else placement.neighbour(s, op.chunk, -op.kind.step)
            if out is not None:  # the consumer of what this operation produces
                transfers.append(Transfer(op.kind, s, out[0], out[1], op.micro_batch))
        if not transfers and all(r.op is None for r in step):
            raise ValueError(f"pipeline schedule pp={pp} m={m} v={v} cannot complete: stages "
                             f"wait at {[orders[s][position[s]] for s in range(pp)]}")
        for t in transfers:
            if t.src == t.dst:
                step[t.src].local.append(t)
            else:
                step[t.src].sends.append(t)
                step[t.dst].recvs.append(t)
            arrived[t.dst].add((t.kind, t.chunk, t.micro_batch))
        for s in range(pp):
            if step[s].op is not None or step[s].sends or step[s].recvs or step[s].local:
                rounds[s].append(step[s])
    return tuple(tuple(r) for r in rounds)


def _live_changes(order: List[Op]):
    """(op, +1 / -1 / 0): a forward makes a (chunk, micro-batch) hold activations, its last
    backward operation (W where the order has them, else B) frees what is left of them."""
    release = W if any(op.kind is W for op in order) else B
    for op in order:
        yield op, 1 if op.kind is F else (-1 if op.kind is release else 0)


def max_in_flight(pp: int, stage: int, m: int, v: int = 1, schedule: str = "auto") -> int:
    """Most (chunk, micro-batch) pairs whose activations `stage` holds at once (from their F
    to their last backward operation)."""
    return max(sum(counts) for counts in _live_peaks(pp, stage, m, v, schedule))


def peak_live_bytes(pp: int, stage: int, m: int, v: int, chunk_bytes: List[float],
                    schedule: str = "auto") -> float:
    """Most activation bytes `stage` holds at once, given each chunk's bytes per micro-batch
    (under a split backward counted until W: an upper bound, as B frees part of them)."""
    return max(sum(n * b for n, b in zip(counts, chunk_bytes))
               for counts in _live_peaks(pp, stage, m, v, schedule))


def unwaited_sends(pp: int, stage: int, m: int, v: int = 1, schedule: str = "auto") -> int:
    """Tensors `stage` has sent in rounds that receive nothing, up to its last forward: a
    backend whose sends report completion only once waited for (gloo) keeps them until the
    end of the step (`PendingBatch`; NCCL reports completion, and they go as they are sent),
    so they are alive at the stage's last activation peak."""
    rounds = plan_rounds(pp, m, v, False, schedule)[stage]
    last = max((i for i, r in enumerate(rounds) if r.op is not None and r.op.kind is F),
               default=-1)
    return sum(len(r.sends) for r in rounds[:last + 1] if r.sends and not r.recvs)


@lru_cache(maxsize=4096)
def _live_peaks(pp: int, stage: int, m: int, v: int, schedule: str = "auto"
                ) -> Tuple[Tuple[int, ...], ...]:
    """The live (chunk, micro-batch) counts per chunk wherever `stage`'s order stops adding
    activations (a releasing or neutral operation, or the end, follows): every peak of the
    live bytes is at one of them, whatever each chunk's bytes (cached: the planner's search
    asks for thousands of plans)."""
    live, peaks = [0] * v, set()
    changes = list(_live_changes(stage_order(pp, stage, m, v, schedule)))
    for i, (op, change) in enumerate(changes):
        live[op.chunk] += change
        if change == 1 and (i + 1 == len(changes) or changes[i + 1][1] != 1):
            peaks.add(tuple(live))
    return tuple(sorted(peaks)) or ((0,) * v,)
