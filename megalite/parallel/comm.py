"""Instrumented collectives: every byte megalite sends goes through here and is counted.

Each call records, per (group, op): the number of calls, the payload bytes (the size of the
logical tensor being reduced / gathered / sent) and the ring *wire* bytes each rank sends for
it, using the standard ring costs (Patarasuk & Yuan 2009; as in NCCL's busbw):

    all_reduce        2 (N - 1) / N * S      (S = tensor bytes)
    reduce_scatter    (N - 1) / N * S        (S = full, unscattered input bytes)
    all_gather        (N - 1) / N * S        (S = full, gathered output bytes)
    broadcast         (N - 1) / N * S        (pipelined ring)
    send              S                      (pipeline point-to-point)

A group of size 1 communicates nothing and records nothing. The counters live in the
`CommCounter` owned by the `Topology`; no module state. With `CommCounter.waits` set (straggler
reports, `megalite.resilience.stragglers`), every call that can block on peers — a blocking
collective, the wait for an asynchronous one or for point-to-point transfers — is also timed.
With `CommCounter.flight` set (`megalite.resilience.flight`), every call is also reported to
that flight recorder: launched, waited for, done or failed (the last collectives of a hang);
`megalite.parallel.comm_calls` does that, and raises `CommError` (importable from here).
"""
from __future__ import annotations

import pickle
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megalite.parallel.comm_calls import CommError, _call, _Done, _launch  # noqa: F401 (re-exported)


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0  # payload bytes
    wire_bytes: float = 0.0  # ring bytes sent by this rank


class CollectiveWaits:
    """Time spent in every call of the training thread that can wait for peers: the time a
    rank spends there is not its own compute (a slow peer makes it long). Taken on the
    device's timeline (`megalite.clock`): on CUDA a pair of events in the current stream,
    which waits for the collective there, so a pair measures the stream's stall — kept in
    `marks` until `StepTimers` resolves them; on CPU (gloo) the host blocks in the call, and
    the seconds add up at once (no object kept per call). Launching an asynchronous
    collective is timed too (it returns at once)."""

    def __init__(self, clock):
        self.clock = clock
        self.marks: List[Tuple[object, object]] = []  # CUDA: events not yet resolved
        self.seconds = 0.0  # CPU: the total so far
        self.calls = 0

    def timed(self, fn):
        start = self.clock.mark()
        try:
            return fn()
        finally:
            end = self.clock.mark()
            self.calls += 1
            if self.clock.cuda:
                self.marks.append((start, end))
            else:
                self.seconds += end - start

    def position(self):
        """Where the record stands now (for `between`)."""
        return len(self.marks) if self.clock.cuda else self.seconds

    def between(self, first, last) -> float:
        """Seconds waited between two positions (on CUDA: waits for the events)."""
        if not self.clock.cuda:
            return last - first
        return sum(self.clock.seconds(a, b) for a, b in self.marks[first:last])

    def clear(self) -> None:
        """Forget the marks (positions taken before are void on CUDA)."""
        self.marks.clear()


@dataclass
class CommCounter:
    """Byte counters keyed by (group name, op); with `waits`, the time spent in the calls."""

    stats: Dict[Tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    # a background checkpoint thread records too (on the checkpoint group's own counter,
    # which never times waits)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    waits: Optional[CollectiveWaits] = field(default=None, repr=False, compare=False)
    flight: Optional[object] = field(default=None, repr=False, compare=False)  # FlightRecorder

    def record(self, group: str, op: str, payload: int, wire: float) -> None:
        with self.lock:
            s = self.stats[(group, op)]
            s.calls += 1
            s.bytes += payload
            s.wire_bytes += wire

    def snapshot(self) -> Dict[str, Dict[str, float]]:
        """{"<group>/<op>": {"calls", "bytes", "wire_bytes"}} — cumulative since creation."""
        with self.lock:
            return {f"{g}/{op}": {"calls": s.calls, "bytes": s.bytes,
                                  "wire_bytes": s.wire_bytes}
                    for (g, op), s in sorted(self.stats.items())}

    @staticmethod
    def delta(new: Dict[str, Dict[str, float]], old: Dict[str, Dict[str, float]]
              ) -> Dict[str, Dict[str, float]]:
        """Counts between two snapshots (e.g. over one logging interval)."""
        out = {}
        for key, cur in new.items():
            prev = old.get(key, {})
            out[key] = {k: v - prev.get(k, 0) for k, v in cur.items()}
        return out


@dataclass
class Group:
    """A process group this rank belongs to, with its name and the counter to report to."""

    name: str
    ranks: List[int]
    rank: int  # this process's index inside the group
    pg: Optional[dist.ProcessGroup]
    counter: CommCounter

    @property
    def size(self) -> int:
        return len(self.ranks)


def single_rank_group(name: str) -> Group:
    """A group of this process alone: what a model built outside any layout communicates
    over (nothing; every collective on it is a no-op)."""
    return Group(name=name, ranks=[0], rank=0, pg=None, counter=CommCounter())


def _ring(n: int) -> float:
    return (n - 1) / n


# torch >= 2.12 renamed the tensor-based collectives; older releases (e.g. the CUDA images' 2.11)
# have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce. Returns the tensor, or a Work to wait on with async_op=True."""
    if group.size > 1:
        nbytes = _nbytes(tensor)
        group.counter.record(group.name, "all_reduce", nbytes, 2 * _ring(group.size) * nbytes)
        work = _launch("all_reduce", group, nbytes, lambda: dist.all_reduce(
            tensor, op=op, group=group.pg, async_op=async_op), async_op)
        if async_op:
            return work
    return _Done() if async_op else tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group,
                   op=dist.ReduceOp.SUM, async_op: bool = False):
    """output (1/N of input, along dim 0) = this rank's chunk of the sum of inputs."""
    if group.size == 1:
        output.copy_(input)
        return _Done() if async_op else output
    nbytes = _nbytes(input)
    group.counter.record(group.name, "reduce_scatter", nbytes, _ring(group.size) * nbytes)
    work = _launch("reduce_scatter", group, nbytes, lambda: _reduce_scatter_single(
        output, input, op=op, group=group.pg, async_op=async_op), async_op)
    return work if async_op else output


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False):
    """output (N x input, along dim 0) = concatenation of every rank's input."""
    if group.size == 1:
        output.copy_(input)
        return _Done() if async_op else output
    nbytes = _nbytes(output)
    group.counter.record(group.name, "all_gather", nbytes, _ring(group.size) * nbytes)
    work = _launch("all_gather", group, nbytes, lambda: _all_gather_single(
        output, input, group=group.pg, async_op=async_op), async_op)
    return work if async_op else output


def broadcast(tensor: torch.Tensor, group: Group, src_index: int = 0) -> torch.Tensor:
    """Broadcast from the group member with index `src_index` (not a global rank)."""
    if group.size > 1:
        nbytes = _nbytes(tensor)
        group.counter.record(group.name, "broadcast", nbytes, _ring(group.size) * nbytes)
        _launch("broadcast", group, nbytes,
                lambda: dist.broadcast(tensor, src=group.ranks[src_index], group=group.pg))
    return tensor


def all_reduce_scalars(values: List[float], group: Group, device: torch.device,
                       op=dist.ReduceOp.SUM) -> List[float]:
    """All-reduce a few Python floats in one fp64 message (metrics, norms), staged on
    `device` (the run's: NCCL carries no CPU tensors)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    all_reduce(t, group, op=op)
    return t.tolist()


# --- object collectives (checkpoint protocol, run set-up): pickled Python objects, counted
# under "<group>.objects" so that the tensor traffic of each group keeps its meaning ---------


def _record_objects(group: Group, op: str, obj) -> int:
    size = len(pickle.dumps(obj))
    group.counter.record(f"{group.name}.objects", op, size, size)
    return size


def gather_objects_to_root(obj, group: Group) -> Optional[List]:
    """Every member's `obj`, in group order, on the member with index 0 (None elsewhere): the
    root holds O(group) objects, every other member only its own."""
    if group.size == 1:
        return [obj]
    size = _record_objects(group, "gather_object", obj)
    out: Optional[List] = [None] * group.size if group.rank == 0 else None
    _launch("gather_object", group, size, lambda: dist.gather_object(
        obj, out, dst=group.ranks[0], group=group.pg))
    return out


def broadcast_object(obj, group: Group, src_index: int = 0):
    """The `obj` of the member with index `src_index`, on every member."""
    if group.size == 1:
        return obj
    box = [obj]
    size = _record_objects(group, "broadcast_object", obj) if group.rank == src_index else 0
    _launch("broadcast_object", group, size, lambda: dist.broadcast_object_list(
        box, src=group.ranks[src_index], group=group.pg))
    return box[0]


def barrier(group: Group) -> None:
    if group.size > 1:
        _launch("barrier", group, 0, lambda: dist.barrier(group=group.pg))


class PendingBatch:
    """A posted batch of point-to-point operations: `wait()` (idempotent) blocks until all of
    them are done, `done()` asks without blocking (NCCL answers as the operations finish;
    gloo's operations report completion only once waited for). It holds the sent tensors
    until then."""

    def __init__(self, works, group: Group, sent: List[torch.Tensor], entry=None):
        self._works, self._group, self._sent, self._entry = list(works), group, sent, entry

    def done(self) -> bool:
        if self._works and all(w.is_completed() for w in self._works):
            self.wait()  # collects errors, if any
        return not self._works

    def wait(self) -> None:
        works, self._works = self._works, []
        if works:
            _call("send/recv", self._group, lambda: [w.wait() for w in works], self._entry)
        self._sent = []


def send_recv(sends: List[Tuple[torch.Tensor, int]], recvs: List[Tuple[torch.Tensor, int]],
              group: Group, async_op: bool = False) -> Optional[PendingBatch]:
    """Batched point-to-point: post every isend and irecv at once (so two neighbours that
    exchange tensors cannot deadlock), then wait for all, or with `async_op` return the
    `PendingBatch` to wait on. Peers are indices into `group`."""
    ops = [dist.P2POp(dist.isend, t, group.ranks[peer], group=group.pg) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, group.ranks[peer], group=group.pg) for t, peer in recvs]
    for t, _ in sends:
        group.counter.record(group.name, "send", _nbytes(t), _nbytes(t))
    flight, entry = group.counter.flight, None
    if flight is not None and ops:
        entry = flight.started("send/recv", group, sum(_nbytes(t) for t, _ in sends + recvs),
                               peers=sorted({group.ranks[p] for _, p in sends + recvs}))
    works = _call("send/recv", group, lambda: dist.batch_isend_irecv(ops), entry,
                  blocking=False) if ops else []
    batch = PendingBatch(works, group, [t for t, _ in sends], entry)
    if async_op:
        return batch
    batch.wait()
    return None


# --- autograd regions for tensor / sequence parallelism (Shoeybi 2019; Korthikanti 2022) -------
#
#   function               forward                          backward
#   copy_to_tp (f)         identity                         all-reduce
#   reduce_from_tp (g)     all-reduce                       identity
#   scatter_to_seq         keep this rank's sequence chunk  all-gather along the sequence
#   gather_from_seq        all-gather along the sequence    reduce-scatter along the sequence
#   reduce_scatter_to_seq  reduce-scatter along sequence    all-gather along the sequence
#
# Activations are [s, b, h]: the sequence is dim 0, so its chunks are contiguous and map
# directly onto all_gather / reduce_scatter of flat tensors.


def _gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = torch.empty((x.shape[0] * group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return all_gather(out, x.contiguous(), group)


def _reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    if x.shape[0] % group.size:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by tp={group.size}")
    out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return reduce_scatter(out, x.contiguous(), group)


def _split_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    if x.shape[0] % group.size:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by tp={group.size}")
    return x.chunk(group.size, dim=0)[group.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToSeq.apply(x, group)


def gather_from_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromSeq.apply(x, group)


def reduce_scatter_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatterToSeq.apply(x, group)
