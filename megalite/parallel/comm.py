"""Instrumented collectives: every byte megalite sends goes through here and is counted.

Each call records, per (group, op): the number of calls, the payload bytes (the size of the
logical tensor being reduced / gathered / sent) and the ring *wire* bytes each rank sends for
it, using the standard ring costs (Patarasuk & Yuan 2009; as in NCCL's busbw):

    all_reduce        2 (N - 1) / N * S      (S = tensor bytes)
    reduce_scatter    (N - 1) / N * S        (S = full, unscattered input bytes)
    all_gather        (N - 1) / N * S        (S = full, gathered output bytes)
    broadcast         (N - 1) / N * S        (pipelined ring)
    all_to_all        S - S_self             (the rows sent to the other ranks; S the input)
    send              S                      (pipeline point-to-point)

A group of size 1 communicates nothing and records nothing. The counters live in the
`CommCounter` owned by the `Topology`; no module state. With `CommCounter.waits` set (straggler
reports, `megalite.resilience.stragglers`), every call that can block on peers — a blocking
collective, the wait for an asynchronous one or for point-to-point transfers — is also timed.
With `CommCounter.flight` set (`megalite.resilience.flight`), every call is also reported to
that flight recorder: launched, waited for, done or failed (the last collectives of a hang);
`megalite.parallel.calls` does that, and raises `CommError`. The groups and counters are
`megalite.parallel.group`'s; the autograd regions of TP/SP, `megalite.parallel.regions`.
"""
from __future__ import annotations

import pickle
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megalite.parallel.calls import Done, events_around, launch, run_guarded, wait_for
from megalite.parallel.group import Group
from megalite.utils.clock import stream_point


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
        work = launch("all_reduce", group, nbytes, lambda: dist.all_reduce(
            tensor, op=op, group=group.pg, async_op=async_op), async_op, tensor.is_cuda)
        if async_op:
            return work
    return Done() if async_op else tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group,
                   op=dist.ReduceOp.SUM, async_op: bool = False):
    """output (1/N of input, along dim 0) = this rank's chunk of the sum of inputs."""
    if group.size == 1:
        output.copy_(input)
        return Done() if async_op else output
    nbytes = _nbytes(input)
    group.counter.record(group.name, "reduce_scatter", nbytes, _ring(group.size) * nbytes)
    work = launch("reduce_scatter", group, nbytes, lambda: _reduce_scatter_single(
        output, input, op=op, group=group.pg, async_op=async_op), async_op, input.is_cuda)
    return work if async_op else output


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False):
    """output (N x input, along dim 0) = concatenation of every rank's input."""
    if group.size == 1:
        output.copy_(input)
        return Done() if async_op else output
    nbytes = _nbytes(output)
    group.counter.record(group.name, "all_gather", nbytes, _ring(group.size) * nbytes)
    work = launch("all_gather", group, nbytes, lambda: _all_gather_single(
        output, input, group=group.pg, async_op=async_op), async_op, input.is_cuda)
    return work if async_op else output


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Group,
               output_splits: Optional[List[int]] = None,
               input_splits: Optional[List[int]] = None) -> torch.Tensor:
    """Member j receives `input`'s j-th chunk along dim 0 (`input_splits[j]` rows, equal chunks
    when None) into its `output`, whose i-th chunk (`output_splits[i]` rows) comes from member
    i (MoE's token exchange, `megalite.model.moe.dispatcher`). Counted: the payload is the
    input, the wire the rows that leave this rank."""
    if group.size == 1:
        output.copy_(input)
        return output
    nbytes = _nbytes(input)
    row = nbytes // max(1, input.shape[0])
    own = (input_splits[group.rank] if input_splits is not None
           else input.shape[0] // group.size) * row
    group.counter.record(group.name, "all_to_all", nbytes, nbytes - own)
    launch("all_to_all", group, nbytes, lambda: dist.all_to_all_single(
        output, input, output_splits, input_splits, group=group.pg), cuda=input.is_cuda)
    return output


def broadcast(tensor: torch.Tensor, group: Group, src_index: int = 0) -> torch.Tensor:
    """Broadcast from the group member with index `src_index` (not a global rank)."""
    if group.size > 1:
        nbytes = _nbytes(tensor)
        group.counter.record(group.name, "broadcast", nbytes, _ring(group.size) * nbytes)
        launch("broadcast", group, nbytes,
               lambda: dist.broadcast(tensor, src=group.ranks[src_index], group=group.pg),
               cuda=tensor.is_cuda)
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
    launch("gather_object", group, size, lambda: dist.gather_object(
        obj, out, dst=group.ranks[0], group=group.pg))
    return out


def broadcast_object(obj, group: Group, src_index: int = 0):
    """The `obj` of the member with index `src_index`, on every member."""
    if group.size == 1:
        return obj
    box = [obj]
    size = _record_objects(group, "broadcast_object", obj) if group.rank == src_index else 0
    launch("broadcast_object", group, size, lambda: dist.broadcast_object_list(
        box, src=group.ranks[src_index], group=group.pg))
    return box[0]


def barrier(group: Group) -> None:
    if group.size > 1:
        launch("barrier", group, 0, lambda: dist.barrier(group=group.pg))


class PendingBatch:
    """A posted batch of point-to-point operations: `wait()` (idempotent) blocks until all of
    them are done, `done()` asks without blocking (NCCL answers as the operations finish;
    gloo's operations report completion only once waited for). It holds the sent tensors
    until then."""

    __slots__ = ("_works", "_group", "_sent", "_entry", "_cuda")

    def __init__(self, works, group: Group, sent: List[torch.Tensor], entry=None,
                 cuda: bool = False):
        self._works, self._group, self._sent, self._entry = list(works), group, sent, entry
        self._cuda = cuda

    def done(self) -> bool:
        if self._works and all(w.is_completed() for w in self._works):
            self.wait()  # collects errors, if any
        return not self._works

    def wait(self) -> None:
        works, self._works = self._works, []
        if works:
            wait_for("send/recv", self._group, lambda: [w.wait() for w in works],
                     self._entry, self._cuda)
        self._sent = []


def send_recv(sends: List[Tuple[torch.Tensor, int]], recvs: List[Tuple[torch.Tensor, int]],
              group: Group, async_op: bool = False) -> Optional[PendingBatch]:
    """Batched point-to-point: post every isend and irecv at once (so two neighbours that
    exchange tensors cannot deadlock), then wait for all, or with `async_op` return the
    `PendingBatch` to wait on. Peers are indices into `group`.

    Counted once per batch (the bytes of its sends, one call per send), recorded by the flight
    recorder once per batch, with its peers. Posting is not timed on CPU (gloo posts without
    waiting for the peer); on CUDA it is (NCCL may block there, e.g. creating the pair's
    communicator at the first transfer)."""
    if not (sends or recvs):
        return PendingBatch([], group, []) if async_op else None
    ranks, pg = group.ranks, group.pg
    ops = [dist.P2POp(dist.isend, t, ranks[peer], group=pg) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, ranks[peer], group=pg) for t, peer in recvs]
    sent = [t for t, _ in sends]
    counter = group.counter
    if sent:
        nbytes = sum(_nbytes(t) for t in sent)
        counter.record(group.name, "send", nbytes, nbytes, calls=len(sent))
    cuda = ops[0].tensor.is_cuda
    flight, entry = counter.flight, None
    if flight is not None:
        nbytes = sum(_nbytes(op.tensor) for op in ops)
        entry = flight.started("send/recv", group, nbytes,
                               peers=sorted({ranks[p] for _, p in sends + recvs}))
    if cuda:
        before = stream_point() if entry is not None and counter.waits is None else None
        works = run_guarded("send/recv", group, lambda: dist.batch_isend_irecv(ops), entry)
        if entry is not None:  # NCCL's works report completion as it happens
            before, _ = events_around(group, before)
            flight.arrives_when(entry, before)
            flight.complete_when(entry, list(works))
    else:
        works = run_guarded("send/recv", group, lambda: dist.batch_isend_irecv(ops), entry,
                            timed=False)
    batch = PendingBatch(works, group, sent, entry, cuda)
    if async_op:
        return batch
    batch.wait()
    return None


# --- along the sequence (dim 0 of [s, b, h] activations: contiguous chunks) -------------------


def gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[s, ...] -> [s * N, ...]: every member's sequence chunk, in group order."""
    out = torch.empty((x.shape[0] * group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return all_gather(out, x.contiguous(), group)


def reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[s, ...] -> [s / N, ...]: this member's chunk of the sum over the group."""
    if x.shape[0] % group.size:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by tp={group.size}")
    out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return reduce_scatter(out, x.contiguous(), group)


def split_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[s, ...] -> this member's [s / N, ...] chunk (no communication)."""
    if x.shape[0] % group.size:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by tp={group.size}")
    return x.chunk(group.size, dim=0)[group.rank].contiguous()
