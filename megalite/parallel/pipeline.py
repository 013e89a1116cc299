"""Pipeline parallelism: point-to-point links and the executor of the
schedules in `megalite.parallel.schedule` (1F1B, interleaved 1F1B over several model chunks
per rank, and zero-bubble ZB-H1, whose backward runs as B and a later W: each chunk's layers
defer their weight gradients to the chunk's `WeightGradQueue` while a B runs, and the W of the
same (chunk, micro-batch) computes them; see `megalite.parallel.weight_grad`).

Activations travel forward and their gradients backward through batched isend/irecv with shapes
known from the configuration (no shape handshake), grouped in the schedule's rounds so that no
two ranks can wait on each other. A round's batch is posted without waiting for it: a stage
waits for a received tensor only when an operation consumes it, and for its sends only at the
end of the step (Megatron's overlap_p2p_comm), so a stage that is ahead never waits for a
slower neighbour's operation of the same round. Once sent, a stage's output keeps only its
autograd graph (Megatron's "deallocate_output_tensor"); its memory goes once its batch and the
batches posted before it are done (NCCL reports that as it happens; gloo only when waited for,
so on CPU at the end of the step). A backward is started with the received gradient directly
on the autograd engine.
"""
from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd import Variable

from megalite.config.schedule_rules import resolve_schedule
from megalite.parallel import comm
from megalite.parallel.group import Group
from megalite.parallel.schedule import SPLIT_BACKWARD, F, Op, OpKind, W, plan_rounds
from megalite.parallel.topology import Topology
from megalite.parallel.weight_grad import (
    WeightGrad,
    WeightGradQueue,
    attach_weight_grad_queue,
    run_weight_grads,
)
from megalite.utils.clock import DeviceClock


class StageLink:
    """Point-to-point traffic of one stage with the other stages of its pipeline group: the
    shapes of what travels, and how.

    With TP and without SP every TP rank of a stage holds the same activation (and the same
    input gradient): `scatter_group` (the TP group) makes each TP rank send only its 1/tp of
    the flattened tensor to its peer (the same TP rank of the next / previous stage), and the
    receiver all-gathers the pieces within its TP group (Narayanan et al. 2021, §4.1, the
    scatter/gather optimization): the pipeline's bytes drop by tp, for an all-gather over the
    fast intra-node TP links."""

    def __init__(self, topo: Topology, shape: Tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, scatter_group: Optional[Group] = None):
        self.group = topo.pp_group
        self.shape, self.dtype, self.device = shape, dtype, device
        self.scatter = scatter_group if scatter_group is not None and \
            scatter_group.size > 1 else None
        numel = math.prod(shape)
        self.wire_shape = shape if self.scatter is None else (numel // self.scatter.size,)
        # With NCCL, every member of a group must take part in its first call (the note of
        # torch.distributed.batch_isend_irecv), and a schedule's first transfers involve
        # only some stages: one collective over the pipeline group first.
        comm.all_reduce(torch.zeros(1, device=device), self.group)

    def exchange(self, sends: Sequence[Tuple[torch.Tensor, int]], sources: Sequence[int]
                 ) -> Tuple[List[torch.Tensor], comm.PendingBatch]:
        """Post one batch: send each (tensor, stage), receive one tensor from each source stage
        (in this order). Returns the receive buffers and the batch, which must be waited for
        before they are read (then `arrived` makes a buffer the tensor that was sent)."""
        received = [torch.empty(self.wire_shape, dtype=self.dtype, device=self.device)
                    for _ in sources]
        batch = comm.send_recv([(self._outgoing(t), peer) for t, peer in sends],
                               list(zip(received, sources)), self.group, async_op=True)
        return received, batch

    def _outgoing(self, t: torch.Tensor) -> torch.Tensor:
        if self.scatter is None:
            return t.contiguous()
        return t.reshape(-1).chunk(self.scatter.size)[self.scatter.rank].contiguous()

    def arrived(self, buffer: torch.Tensor) -> torch.Tensor:
        """The sent tensor from a received buffer (with scatter: gathered over TP; every TP
        rank of the stage consumes its transfers in the same order, so the gathers match)."""
        if self.scatter is None:
            return buffer
        full = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        comm.all_gather(full.view(-1), buffer, self.scatter)
        return full


@dataclass
class Event:
    kind: OpKind
    micro_batch: int
    start: float  # seconds since the step began
    end: float
    chunk: int = 0


@dataclass
class StepTrace:
    """F/B/W compute events of one stage in one step, and the step's wall time."""

    events: List[Event] = field(default_factory=list)
    wall: float = 0.0

    @property
    def busy(self) -> float:
        return sum(e.end - e.start for e in self.events)

    def dump(self, path: Path, stage: int, rank: int) -> None:
        """Chrome trace format (chrome://tracing, ui.perfetto.dev): one row per stage."""
        events = [{"name": f"{OpKind(e.kind).value}{e.micro_batch}"
                   + (f".{e.chunk}" if e.chunk else ""),
                   "ph": "X", "pid": 0, "tid": stage,
                   "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                   "args": {"rank": rank, "micro_batch": e.micro_batch, "chunk": e.chunk}}
                  for e in self.events]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _take(received: dict, key: Tuple[OpKind, int, int], link: StageLink) -> torch.Tensor:
    """A received tensor, once the batch that brought it is done (a local hand-off, from this
    stage's other chunk, has no batch and is whole)."""
    tensor, batch = received.pop(key)
    if batch is None:
        return tensor
    batch.wait()
    return link.arrived(tensor)


def micro_batch_parts(batch: Sequence) -> Tuple:
    """(inputs, targets, documents) of a micro-batch: (inputs, targets), or with the documents
    its attention, positions and loss follow (`megalite.data.documents`; every stage has them,
    read from its own copy of the batch: they never travel between stages)."""
    return (batch[0], batch[1], None) if len(batch) == 2 else tuple(batch)


def _backward_from(output: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """Backward through `output`'s graph even though `output` itself was freed after sending
    (its shape no longer matches `grad`; the autograd engine does not check it)."""
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


@dataclass
class _Pass:
    """One run of a schedule's rounds (a training step, or a forward-only evaluation): the
    transfers in flight, the activations kept for backward and what the losses add up to."""

    micro_batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]
    training: bool
    loss_scale: float = 1.0
    loss_sum: torch.Tensor = None  # on the device: no sync until the caller reads it
    received: Dict[Tuple[OpKind, int, int], Tuple[torch.Tensor, comm.PendingBatch]] = \
        field(default_factory=dict)
    posted: Deque[comm.PendingBatch] = field(default_factory=deque)
    live: Dict[Tuple[int, int], Tuple[Optional[torch.Tensor], torch.Tensor]] = \
        field(default_factory=dict)
    deferred: Dict[Tuple[int, int], List[WeightGrad]] = field(default_factory=dict)  # B done,
    #                                                          W to come (zero-bubble schedules)
    marks: list = field(default_factory=list)
    peak_in_flight: int = 0
    per_sequence: Optional[Dict[int, torch.Tensor]] = None  # scoring: micro-batch -> losses [b]


class PipelineSchedule:
    """Runs one stage's part of a training step or of a forward-only evaluation.

    A micro-batch is (inputs, targets); a stage reads only its part — the inputs where it holds
    the first chunk, the targets where it holds the last — and the other may be None. A third
    element, the micro-batch's documents (document masking, reset positions, EOS loss), goes to
    every chunk's forward as `documents`.

    `chunks` are this rank's model chunks (one GPT2 stage each; several with the interleaved
    schedule), `chunk(inputs, labels)` the forward; `engine` gets told before each backward
    (each B and each W under a zero-bubble schedule) which of the step's micro-batches the
    gradients that follow belong to (its buckets complete, and sync over DP, per micro-batch).
    For pp = 1 this is plain gradient accumulation: forward, backward, for each micro-batch.
    Training and evaluation run the same round loop (`_run`). `schedule` is
    `parallel.schedule` (auto: interleaved with several chunks, else 1F1B).
    """

    def __init__(self, chunks: Sequence, topo: Topology, engine,
                 activation_shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 scatter_group: Optional[Group] = None, schedule: str = "auto"):
        self.chunks, self.topo, self.engine = list(chunks), topo, engine
        self.schedule = resolve_schedule(schedule, len(self.chunks))
        self.weight_queues: Optional[List[WeightGradQueue]] = None
        if self.schedule in SPLIT_BACKWARD:
            self.weight_queues = [WeightGradQueue() for _ in self.chunks]
            for chunk, queue in zip(self.chunks, self.weight_queues):
                attach_weight_grad_queue(chunk, queue)
        self.link = StageLink(topo, activation_shape, dtype, device, scatter_group)
        self.clock = DeviceClock(device)
        self._marks: list = []
        self._step_marks = None
        self.holds_loss = any(chunk.last for chunk in self.chunks)  # zb-v: stage 0
        # most (chunk, micro-batch) activations this stage held at once in the last step, from
        # F to the last backward operation (1F1B: at most pp - stage; ZB-H1: at most pp;
        # logged as pipeline_in_flight)
        self.peak_in_flight = 0

    def _rounds(self, m: int, forward_only: bool):
        stage = self.topo.coords.pp_rank
        return plan_rounds(self.topo.pp_size, m, len(self.chunks), forward_only,
                           self.schedule)[stage]

    def train_step(self, micro_batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                   loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean loss on the stage with
        the LM head (the last; zb-v: the first), 0 elsewhere, as a device scalar: reading it
        waits for the device, which the caller does after the step's gradient sync is
        enqueued. Gradients of the mean loss over the
        micro-batches, times `loss_scale` (fp16 loss scaling; the engine unscales),
        accumulate: each chunk's `objective_scale` is that weight of a micro-batch (the
        gradient a chunk without the LM head gives its MoE balancing penalty)."""
        m = len(micro_batches)
        for chunk in self.chunks:  # what a micro-batch weighs in the objective (as below for
            chunk.objective_scale = loss_scale / m  # the loss): a chunk's MoE penalty's weight
        step_start = self.clock.mark()
        run = _Pass(micro_batches, training=True, loss_scale=loss_scale,
                    loss_sum=torch.zeros((), device=self.link.device))
        self._run(self._rounds(m, forward_only=False), run)
        self.peak_in_flight = run.peak_in_flight
        self._marks, self._step_marks = run.marks, (step_start, self.clock.mark())
        return run.loss_sum / m if self.holds_loss else torch.zeros_like(run.loss_sum)

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward-only pass; the mean loss on the stage with the LM head (0.0 elsewhere). The
        losses add up on the device in fp64 (as Python floats would): one sync per evaluation."""
        run = _Pass(micro_batches, training=False, loss_sum=torch.zeros(
            (), dtype=torch.float64, device=self.link.device))
        self._run(self._rounds(len(micro_batches), forward_only=True), run)
        return run.loss_sum.item() / len(micro_batches) if self.holds_loss else 0.0

    @torch.no_grad()
    def sequence_losses(self, micro_batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                        device: torch.device) -> Optional[torch.Tensor]:
        """Forward-only pass scoring each sequence: on the stage with the LM head the summed
        cross-entropy of every sequence over its labels >= 0 (`GPT2.sequence_losses`),
        micro-batch after micro-batch [m * b] in fp64; None on the other stages. `micro_batches` may build
        each (inputs, labels) pair when it is indexed."""
        run = _Pass(micro_batches, training=False, per_sequence={},
                    loss_sum=torch.zeros((), dtype=torch.float64, device=device))
        self._run(self._rounds(len(micro_batches), forward_only=True), run)
        if not self.holds_loss:
            return None
        return torch.cat([run.per_sequence[i] for i in range(len(micro_batches))])

    def _run(self, rounds, run: _Pass) -> None:
        """The round loop: each round's operation, then its exchange; a sent activation keeps
        only its graph. Every posted batch is done at the end."""
        gathering = [r.op for r in rounds if r.op is not None and r.op.kind is not W]
        following = dict(zip(gathering, gathering[1:]))  # each F / B: the stage's next F / B
        for rnd in rounds:
            op, outgoing = rnd.op, []
            if op is not None:
                if op.kind is not W:  # (ZeRO-3 prefetches the next one's first unit)
                    self.engine.before_op(op, following.get(op))
                outgoing = self._operate(op, run)
            self._exchange(rnd, outgoing, run.received, run.posted)
            if run.training and op is not None and op.kind is F and outgoing:
                out = outgoing[0]  # sent (the batch holds it until done): keep only the graph
                out.data = torch.empty(1, dtype=out.dtype, device=out.device)
        for batch in run.posted:
            batch.wait()

    def _operate(self, op: Op, run: _Pass) -> List[torch.Tensor]:
        """Run one operation; returns what it sends on (an activation or input gradient)."""
        model, key = self.chunks[op.chunk], (op.chunk, op.micro_batch)
        # the received input first (it may still be in flight): waiting is not computing
        edge = op.kind is W or (model.first if op.kind is F else model.last)
        arrived = None if edge else _take(run.received, (op.kind, *key), self.link)
        t0 = self.clock.mark()
        if op.kind is F:
            outgoing = self._forward(model, key, arrived, run)
        elif op.kind is W:
            self.engine.before_backward(key[1], len(run.micro_batches))
            run_weight_grads(run.deferred.pop(key))
            outgoing = []
        else:
            outgoing = self._backward(model, key, arrived, run)
        if run.training:
            run.marks.append((op.kind, op.micro_batch, op.chunk, t0, self.clock.mark()))
        return outgoing

    def _forward(self, model, key: Tuple[int, int], arrived: Optional[torch.Tensor],
                 run: _Pass) -> List[torch.Tensor]:
        x, y, documents = micro_batch_parts(run.micro_batches[key[1]])
        inp = x if arrived is None else arrived
        extra = {} if documents is None else {"documents": documents}
        if not run.training:
            if model.last and run.per_sequence is not None:
                run.per_sequence[key[1]] = model(inp, y, per_sequence=True, **extra)
                return []
            out = model(inp, y if model.last else None, **extra)
            if model.last:
                run.loss_sum += out.double()
                return []
            return [out]
        if arrived is not None:
            inp.requires_grad_()
        out = model(inp, y if model.last else None, **extra)
        if model.last:
            run.loss_sum += out.detach()
            out = out / len(run.micro_batches)
            if run.loss_scale != 1.0:
                out = out * run.loss_scale
        run.live[key] = (None if model.first else inp, out)
        run.peak_in_flight = max(run.peak_in_flight, len(run.live) + len(run.deferred))
        return [] if model.last else [out]

    def _backward(self, model, key: Tuple[int, int], arrived: Optional[torch.Tensor],
                  run: _Pass) -> List[torch.Tensor]:
        inp, out = run.live.pop(key)
        self.engine.before_backward(key[1], len(run.micro_batches))
        grad = torch.ones_like(out) if arrived is None else arrived
        if self.weight_queues is None:
            _backward_from(out, grad)
        else:  # B: the input gradients only; the weight gradients wait for this key's W
            with self.weight_queues[key[0]].collecting() as weight_grads:
                _backward_from(out, grad)
            run.deferred[key] = weight_grads
        return [] if model.first else [inp.grad]

    def _exchange(self, rnd, outgoing: List[torch.Tensor], received: dict,
                  posted: Deque[comm.PendingBatch]) -> None:
        """Post the round's batch: what this round's operation produced goes to its consumer,
        and the transfers addressed to this stage are received into `received` (waited for by
        `_take`). `posted` keeps the batches, oldest first, until they are known to be done
        (they hold the sent tensors); only the oldest are asked, so a round costs O(1) even
        where completion is never reported before a wait (gloo)."""
        for t, tr in zip(outgoing, rnd.local):  # zb-v's turn: to this stage's other chunk
            received[(tr.kind, tr.chunk, tr.micro_batch)] = (t.detach(), None)
        if not (rnd.sends or rnd.recvs):
            return
        sends = [(t.detach(), tr.dst) for t, tr in zip(outgoing, rnd.sends)]
        tensors, batch = self.link.exchange(sends, [tr.src for tr in rnd.recvs])
        for tr, t in zip(rnd.recvs, tensors):
            received[(tr.kind, tr.chunk, tr.micro_batch)] = (t, batch)
        posted.append(batch)
        while posted and posted[0].done():
            posted.popleft()

    @property
    def trace(self) -> StepTrace:
        """The last step's F/B/W events (on CUDA this waits for that step to finish)."""
        if self._step_marks is None:
            return StepTrace()
        start, end = self._step_marks
        return StepTrace([Event(k, i, self.clock.seconds(start, a), self.clock.seconds(start, b), c)
                          for k, i, c, a, b in self._marks], self.clock.seconds(start, end))
