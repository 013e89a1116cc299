"""Pipeline parallelism: stage partition, point-to-point links and the 1F1B schedule
(Narayanan et al. 2021, "PipeDream-Flush"; Megatron-LM's non-interleaved schedule).

With p stages and m micro-batches, stage s runs

    warmup   = min(p - s - 1, m) forwards
    steady   = m - warmup times: one forward, then one backward (oldest micro-batch first)
    cooldown = warmup backwards

so at most p - s micro-batches have live activations on stage s (instead of m under GPipe),
and the idle "bubble" is (p - 1) / (m + p - 1) of the step when forward and backward times are
equal across stages. Activations travel forward and their gradients backward through batched
isend/irecv with shapes known from the configuration (no shape handshake); every exchange
between neighbours posts its send and its receive together, so neighbours never wait on each
other's sends. A stage's output is freed as soon as it has been sent (only its autograd graph is
kept; Megatron's "deallocate_output_tensor"), and its backward is started with the received
gradient directly on the autograd engine.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
from torch.autograd import Variable

from megalite.parallel import comm
from megalite.parallel.topology import Topology


def partition_layers(n_layer: int, pp: int, edge_stage_layers: Optional[int] = None
                     ) -> List[range]:
    """Contiguous block ranges per stage. Balanced by default (the remainder goes to the
    middle stages first, as the edges also hold the embedding / head); with
    `edge_stage_layers=k` the first and last stage get k blocks each and the middle stages
    split the rest evenly."""
    if pp < 1 or n_layer < pp:
        raise ValueError(f"pp={pp} needs 1 <= pp <= n_layer={n_layer}")
    if pp == 1:
        return [range(n_layer)]
    if edge_stage_layers is None:
        counts = [n_layer // pp] * pp
        order = list(range(1, pp - 1)) + [0, pp - 1]
        for i in range(n_layer % pp):
            counts[order[i]] += 1
    else:
        middle = pp - 2
        rest = n_layer - 2 * edge_stage_layers
        if edge_stage_layers < 1 or rest < 0 or (middle == 0 and rest != 0) or \
                (middle > 0 and rest < middle):
            raise ValueError(f"edge_stage_layers={edge_stage_layers} leaves no valid split of "
                             f"{n_layer} blocks over {pp} stages")
        counts = [edge_stage_layers] + [rest // max(middle, 1)] * middle + [edge_stage_layers]
        for i in range(rest % max(middle, 1) if middle else 0):
            counts[1 + i] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def schedule_1f1b(pp: int, stage: int, m: int) -> List[Tuple[str, int]]:
    """The (kind, micro-batch) order of stage `stage`: ("F", i) and ("B", i)."""
    warmup = min(pp - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order


def expected_bubble(pp: int, m: int) -> float:
    return (pp - 1) / (m + pp - 1)


class StageLink:
    """Point-to-point traffic of one stage with its neighbours in the pipeline group."""

    def __init__(self, topo: Topology, shape: Tuple[int, ...], dtype: torch.dtype,
                 device: torch.device):
        self.group = topo.pp_group
        self.stage, self.pp = topo.coords.pp, topo.pp
        self.shape, self.dtype, self.device = shape, dtype, device

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def exchange(self, send_next: Optional[torch.Tensor] = None,
                 send_prev: Optional[torch.Tensor] = None, recv_next: bool = False,
                 recv_prev: bool = False) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """One batched exchange; returns (tensor from prev, tensor from next)."""
        sends, recvs = [], []
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        if send_next is not None:
            sends.append((send_next.contiguous(), self.stage + 1))
        if send_prev is not None:
            sends.append((send_prev.contiguous(), self.stage - 1))
        if from_prev is not None:
            recvs.append((from_prev, self.stage - 1))
        if from_next is not None:
            recvs.append((from_next, self.stage + 1))
        comm.send_recv(sends, recvs, self.group)
        return from_prev, from_next


@dataclass
class Event:
    kind: str  # "F" or "B"
    micro_batch: int
    start: float  # seconds since the step began
    end: float


@dataclass
class StepTrace:
    """F/B compute events of one stage in one step, and the step's wall time."""

    events: List[Event] = field(default_factory=list)
    wall: float = 0.0

    @property
    def busy(self) -> float:
        return sum(e.end - e.start for e in self.events)

    @property
    def bubble(self) -> float:
        """Fraction of this stage's own step spent not computing (waiting on neighbours). It
        ends at the stage's last backward, so it leaves out the wait for the earlier stages'
        last backwards; the trainer measures against the longest stage instead."""
        return 1.0 - self.busy / self.wall if self.wall > 0 else 0.0

    def dump(self, path: Path, stage: int, rank: int) -> None:
        """Chrome trace format (chrome://tracing, ui.perfetto.dev): one row per stage."""
        events = [{"name": f"{e.kind}{e.micro_batch}", "ph": "X", "pid": 0, "tid": stage,
                   "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                   "args": {"rank": rank, "micro_batch": e.micro_batch}} for e in self.events]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


class _Clock:
    """Wall-clock marks; on CUDA, events resolved once at the end of the step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


def _backward_from(output: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """Backward through `output`'s graph even though `output` itself was freed after sending
    (its shape no longer matches `grad`; the autograd engine does not check it)."""
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


class PipelineSchedule:
    """Runs one stage's part of a training step (1F1B) or of a forward-only evaluation.

    `stage(inputs, labels)` is the model stage; `engine` gets told which backward is the
    step's last (data-parallel gradient sync happens once, there). For pp = 1 this is plain
    gradient accumulation: forward, backward, for each micro-batch.
    """

    def __init__(self, stage, topo: Topology, engine, activation_shape: Tuple[int, ...],
                 dtype: torch.dtype, device: torch.device):
        self.stage, self.topo, self.engine = stage, topo, engine
        self.first, self.last = topo.is_first_stage, topo.is_last_stage
        self.link = StageLink(topo, activation_shape, dtype, device)
        self.clock = _Clock(device)
        self._marks: list = []
        self._step_marks = None
        self.max_live = 0  # most micro-batches with activations alive at once, this step
        self._pending_grad: Optional[torch.Tensor] = None

    def train_step(self, micro_batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward and backward of every micro-batch; returns the mean loss on the last stage
        (0.0 elsewhere). Gradients of the mean loss over the micro-batches accumulate."""
        m = len(micro_batches)
        link, topo = self.link, self.topo
        marks, step_start = [], self.clock.mark()
        live: List[Tuple[Optional[torch.Tensor], torch.Tensor]] = []  # (input, output) per F
        loss_sum = torch.zeros((), device=micro_batches[0][0].device)
        self.max_live = 0
        received: Optional[torch.Tensor] = None
        order = schedule_1f1b(topo.pp, topo.coords.pp, m)
        backwards_done = 0

        for pos, (kind, i) in enumerate(order):
            nxt = order[pos + 1] if pos + 1 < len(order) else None
            if kind == "F":
                if not self.first and received is None:
                    received, _ = link.exchange(recv_prev=True)
                t0 = self.clock.mark()
                x, y = micro_batches[i]
                inp = x if self.first else received.requires_grad_()
                out = self.stage(inp, y if self.last else None)
                if self.last:
                    loss_sum += out.detach()
                    out = out / m
                marks.append(("F", i, t0, self.clock.mark()))
                live.append((None if self.first else inp, out))
                self.max_live = max(self.max_live, len(live))
                received = None
                if not self.last:
                    # Send the output on; in the steady state receive the gradient of the
                    # oldest in-flight micro-batch in the same exchange.
                    want_grad = nxt is not None and nxt[0] == "B"
                    _, grad = link.exchange(send_next=out.detach(), recv_next=want_grad)
                    out.data = torch.empty(1, dtype=out.dtype, device=out.device)
                    self._pending_grad = grad
            else:
                inp, out = live.pop(0)
                grad = torch.ones_like(out) if self.last else None  # d(loss)/d(loss)
                if not self.last:
                    grad = self._pending_grad
                    if grad is None:
                        _, grad = link.exchange(recv_next=True)
                    self._pending_grad = None
                backwards_done += 1
                self.engine.set_grad_sync(backwards_done == m)
                t0 = self.clock.mark()
                _backward_from(out, grad)
                marks.append(("B", i, t0, self.clock.mark()))
                if not self.first:
                    # Send the input gradient back; if a forward comes next, receive its
                    # input in the same exchange.
                    want_input = nxt is not None and nxt[0] == "F"
                    received, _ = link.exchange(send_prev=inp.grad, recv_prev=want_input)
        self._marks, self._step_marks = marks, (step_start, self.clock.mark())
        return (loss_sum / m).item() if self.last else 0.0

    @property
    def trace(self) -> StepTrace:
        """The last step's F/B events (on CUDA this waits for that step to finish)."""
        if self._step_marks is None:
            return StepTrace()
        start, end = self._step_marks
        return StepTrace([Event(k, i, self.clock.seconds(start, a), self.clock.seconds(start, b))
                          for k, i, a, b in self._marks], self.clock.seconds(start, end))

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward-only pass; the mean loss on the last stage (0.0 elsewhere)."""
        total = 0.0
        for x, y in micro_batches:
            inp = x if self.first else self.link.exchange(recv_prev=True)[0]
            out = self.stage(inp, y if self.last else None)
            if self.last:
                total += out.float().item()
            else:
                self.link.exchange(send_next=out)
        return total / len(micro_batches) if self.last else 0.0
