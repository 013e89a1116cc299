"""Optimizer offload (`offload.optimizer = f`): the fp32 master weights and AdamW moments of
the fraction f of this rank's owned range live in host memory (the masters, gradients and copy
buffers in one allocation per rank, pinned exactly on CUDA: `megalite.parallel.host_arena`) and
are stepped there by PyTorch's CPU AdamW — ZeRO-Offload (Ren et al. 2021), Megatron-Core's
`HybridDeviceOptimizer` (a fraction offloaded), torchao's `CPUOffloadOptimizer`.

Which elements: of every bucket's owned range [lo, hi) the last round(f·(hi − lo)) elements,
[cut, hi) — so every bucket (ZeRO-3: every unit) is split alike and the host work is spread
over the whole model. The device keeps its part [lo, cut) as before; for the host part it
keeps only what the forward needs, the model-dtype parameters (and under zero 0/1 the whole
fp32 gradient it accumulates anyway; under zero 2/3 its reduced gradient shrinks to [lo, cut)).

Three actors: the training thread (it queues compute and copies and never waits for a copy
it does not need yet), one side stream for every copy (CUDA) and one host worker thread
(`megalite-offload`, on the engine's CUDA device; let go at the end of `fit`) that runs the
host's work range by range, in the order it was queued:

    backward   as soon as a bucket's DP reduction is *launched* (`on_launched`, from the
               engine's `_launch`: zero 0/1 during the last micro-batch's backward, zero 2/3
               during every micro-batch's), the side stream waits for that reduction only —
               NCCL: `Work.wait()` under the side stream; a group of one: the compute
               stream as it is at that moment, i.e. the bucket's last gradient — and copies
               the host part device -> host (zero 0/1: straight into the host gradient,
               which the copy overwrites whole, so it is never zeroed; zero 2/3: into a
               staging buffer). The worker then waits for that copy's event and, zero 2/3,
               folds it into the host gradient (the step's first fold copies, later ones
               add: the device's order of sums, without a memset), and, once the range's
               gradient is final, takes the squares of its counted pieces for the global
               norm (`squares_fp32_rows`) — all of it while the backward goes on. On CPU
               with a collective in flight the copy waits for the reduction's completion
               (`on_reduced`): there is no stream to order it after the collective
    grad sync  `drain`: every range's copies landed, folded and squared (the CPU waits for
               the worker: normally only the last bucket's copy is still running); the tied
               embedding's sum, SP's TP sum and the TP-shared KV heads' sum then
               include the host pieces
               (`megalite.parallel.grad_sums`), and the pieces they change are the only
               host pieces whose squares the training thread takes (`grad_norm`)
    norm       host squares (precomputed) + device squares: the trainer's finiteness verdict
               (train.max_bad_steps, the fp16 scaler's overflow skip) and the clip factor
               are decided before anything steps: a skipped step touches neither side
    step       `step(coef, lr)` queues one task per range on the worker, in the order the
               next forward reads them, and returns: the host AdamW with the clip (and fp16's
               unscale) folded in — fused AdamW's `grad_scale` = 1/coef divides the gradient
               inside the update, one pass instead of a separate multiply — then the cast to
               the model dtype, then the range's host -> device copy on the side stream
               (ordered after the backward's last read of the parameters, the event `drain`
               recorded) and its event. The device AdamW is queued on the compute stream
               meanwhile
    next use   each block's parameters are waited for where they are next read
               (`params_needed`: a forward pre-hook on every sharding unit; before zero 1/2's
               all-gather of each bucket; before zero 3's gather of each unit): the CPU waits
               until the worker has issued that range's copy (normally long done for the
               first blocks), then the compute stream — not the CPU — waits for the copy's
               event. So the next forward's first blocks compute while the host still steps
               the last ranges. Whoever reads the host state (checkpoints, the parameter
               norm, the replica check: `ZeroEngine.main_params`) waits for the host step
               first (`step_done`)

On CPU host = device: the same buffers, copies and worker exist (real copies between
separate tensors, no streams), which exercises the path and saves nothing. The time the
training thread is blocked on the offload — waiting for the worker or, on CUDA, the compute
stream waiting for a parameter copy — is the step phase `offload_wait`
(`megalite.train.timers`); `record` draws each copy, host step and wait as a span
(`megalite.parallel.offload_timeline`).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megalite.parallel import host_range
from megalite.parallel.host_arena import HostArena
from megalite.parallel.host_range import AdamWSettings, HostRange, build_adamw, host_adamw_kind, host_parts
from megalite.parallel.offload_params import HostParams
from megalite.parallel.offload_worker import HostWorker
from megalite.parallel.units import forward_order, unit_buckets


def _wait_reduction_on(work, stream) -> bool:
    """Make `stream` wait for the collective behind `work` (a `megalite.parallel.comm`
    handle): on NCCL, `Work.wait()` blocks the *current* stream on the collective's end event
    and returns. False for a group of one, whose 'reduction' ran on the compute stream. The
    backend's handle is waited on directly, at the launch: the engine's own wait when the
    reduction is folded (`ZeroEngine._complete`) is the one the flight recorder, the wait
    timers and CommError see (this one completes nothing and can only enqueue)."""
    if getattr(work, "work", None) is None:
        return False
    with torch.cuda.stream(stream):
        work.work.wait()
    return True


class OptimizerOffload(HostParams):
    """One rank's offloaded optimizer state: a `HostRange` per bucket with a host part (the
    host step and the parameters' way back: `HostParams`)."""

    def __init__(self, chunks, buckets, fraction: float, device: torch.device, timers=None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.gather_stream = torch.cuda.Stream(device) if self.cuda else None  # zero 1/2
        cuts = [(b, b.hi - round(fraction * (b.hi - b.lo))) for b in buckets]
        cuts = [(b, cut) for b, cut in cuts if cut < b.hi]
        self.arena = self._arena(cuts)
        self.ranges: Dict[int, HostRange] = {}
        views = iter([] if self.arena is None else self.arena.tensors())  # in `cuts`' order
        for b, cut in cuts:
            self.ranges[id(b)] = self._split(b, cut, [next(views) for _ in host_parts(b, cut)])
        self.order = [self.ranges[id(b)] for b in forward_order(chunks, buckets)
                      if id(b) in self.ranges]
        self.d2h_bytes = 0  # copied so far (the metrics' PCIe traffic)
        self.h2d_bytes = 0
        self.worker = HostWorker(device, timers)  # the host's tasks, in the order queued
        self.timeline, self._index = None, {}  # `record`
        self._params_free = None  # CUDA: recorded by `drain` after the backward was queued
        # buckets whose parameter copy the device has not waited for yet
        self.pending: Dict[int, HostRange] = {}
        for unit, mine in unit_buckets(chunks, buckets):
            mine = [b for b in mine if id(b) in self.ranges]
            if mine:  # first of the unit's pre-hooks (ahead of ZeRO-3's gather)
                unit.register_forward_pre_hook(self._unit_hook(mine), prepend=True)

    def _arena(self, cuts: List[tuple]) -> Optional[HostArena]:
        """Every range's host buffers in one allocation, pinned exactly on CUDA (`HostArena`):
        the bytes counted are the bytes held."""
        if not cuts:
            return None
        # meta: megalite-verify-rank's shapes
        host = self.device if self.device.type == "meta" else torch.device("cpu")
        return HostArena([p for b, cut in cuts for p in host_parts(b, cut)], pinned=self.cuda,
                         device=host)

    def _split(self, bucket, cut: int, buffers: List[torch.Tensor]) -> HostRange:
        host = HostRange(bucket, cut, buffers)
        bucket.segments = bucket.flat.segments(bucket.lo, cut) + \
            bucket.flat.segments(cut, bucket.hi)
        if bucket.main is not bucket.param_region:  # the device master keeps [lo, cut)
            bucket.main = bucket.main[:host.offset].clone()
        if bucket.grad_full is None:  # zero 2/3: the device sums [lo, cut) only
            bucket.main_grad = bucket.main_grad[:host.offset].clone()
        return host

    def _unit_hook(self, buckets: List):
        def hook(module, args) -> None:
            self.params_needed(buckets)
        return hook

    def close(self) -> None:
        """Let the host worker go (the end of `fit`); a later task starts a new one."""
        self.worker.close()

    def record(self, timeline) -> None:
        """Record where the offload's time goes into `timeline` (an `OffloadTimeline`; None:
        stop): each range's copies, host step and the training thread's waits on it."""
        self.timeline = self.worker.timeline = timeline
        self._index = {id(r): i for i, r in enumerate(self.order)}

    def range_of(self, bucket) -> Optional[HostRange]:
        return self.ranges.get(id(bucket))

    def build_optimizers(self, cfg: AdamWSettings) -> List[torch.optim.AdamW]:
        """The host AdamW of every range with pieces (after `HostRange.piece` made them)."""
        kind = host_adamw_kind()
        for r in self.ranges.values():
            if r.pieces:
                r.optimizer = build_adamw(r.pieces, r.decays, cfg, kind)
                r.fused = kind == "fused"
        return [r.optimizer for r in self.ranges.values() if r.optimizer is not None]

    def count_in_norm(self, bucket, grad: torch.Tensor) -> None:
        """`grad` (a host gradient piece of `bucket`'s range) counts in the global norm and
        no sum after the reduction changes it: the worker squares it once it is final."""
        self.ranges[id(bucket)].norm_pieces.append(grad)

    # --- gradients: device -> host ----------------------------------------------------

    def on_launched(self, bucket, work, reduced: torch.Tensor,
                    source: Optional[torch.Tensor] = None) -> None:
        """`bucket`'s DP reduction was just launched (`work`: its handle; `reduced`: the
        tensor holding its owned range's reduced gradient once it completes; `source`: the
        gradient it reduces): copy the host part device -> host — on CUDA now, on the side
        stream, after that reduction only; on CPU now when nothing is in flight (a group of
        one), else once it completed (`on_reduced`). CUDA: `source` is held until the
        reduction completed on the compute stream: NCCL releases a collective's stashed
        input at its first `wait()` (here, the side stream's), and the compute stream may
        reuse memory nobody holds before it waited itself."""
        r = self.ranges.get(id(bucket))
        if r is None:
            return
        if getattr(work, "work", None) is None:  # a group of one: reduced already
            self._copy_in(r, reduced, work)
        elif self.cuda:
            r.in_flight.append((work, source))
            self._copy_in(r, reduced, work)
        else:
            r.in_flight.append((work, None))  # CPU: the result exists once it completed
            r.deferred += 1

    def on_reduced(self, bucket, reduced: torch.Tensor, work) -> None:
        """A bucket's DP reduction completed (`ZeroEngine._complete`, the compute stream
        ordered after it): CPU: the copy `on_launched` deferred until the result existed;
        CUDA: the reduced gradient's source is let go."""
        r = self.ranges.get(id(bucket))
        if r is None or not any(w is work for w, _ in r.in_flight):
            return
        r.in_flight = [(w, t) for w, t in r.in_flight if w is not work]
        if not self.cuda:
            r.deferred -= 1
            self._copy_in(r, reduced, None)

    def _copy_in(self, r: HostRange, reduced: torch.Tensor, work) -> None:
        self.worker.wait(r.stepped, self._at(r))  # the last host step has read `grad` (a step ago)
        self.worker.wait(r.inbound, self._at(r))  # zero 2/3: the last fold has read `staging`
        src = reduced[r.offset:]
        copied = None
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            if not _wait_reduction_on(work, self.stream):
                self.stream.wait_stream(compute)  # the bucket's gradient, as queued so far
            with torch.cuda.stream(self.stream):
                with self._span("d2h", r):
                    r.staging.copy_(src, non_blocking=True)
                copied = self.stream.record_event()
            src.record_stream(self.stream)  # the compute stream may not reuse it before
        else:
            with self._span("d2h", r):
                r.staging.copy_(src)
        r.inbound = self.worker.submit(host_range.arrived, r, copied, not r.accumulate)
        self.d2h_bytes += 4 * src.numel()

    def drain(self) -> None:
        """After the step's last reduction: every copy landed, folded and squared (zero 2/3:
        the ranges' sums final, their squares taken now). On CUDA also marks where the
        backward's reads of the parameters end."""
        for r in self.ranges.values():
            if r.in_flight:
                raise RuntimeError("offload: a bucket's reduction was never completed")
            if r.accumulate:
                r.inbound = self.worker.submit(host_range.finalize, r)
        for r in self.ranges.values():
            self.worker.wait(r.inbound, self._at(r))
        if self.cuda:
            self._params_free = torch.cuda.current_stream(self.device).record_event()

    def grad_squares(self) -> Optional[torch.Tensor]:
        """The squares (fp64, CPU) of every counted host piece no sum changed after `drain`:
        what the worker took as each range's gradient became final."""
        parts = [r.squares for r in self.ranges.values() if r.squares is not None]
        return torch.stack(parts).sum() if parts else None

    def sum_tied(self, bucket, group, all_reduce) -> None:
        """`all_reduce` over `group` of the tied embedding bucket's reduced gradient, every
        element once (the host part through the device where the backend needs device
        tensors). Zero 0/1: the device's gradient still holds the host part's values as
        copied (nothing changed either since `drain`), so one all-reduce of the device's
        range and a copy of its host part back; zero 2/3: the device keeps [lo, cut) only,
        so both parts go in one all-reduce of their concatenation."""
        r = self.ranges.get(id(bucket))
        if r is None:
            all_reduce(bucket.main_grad, group)
        elif bucket.grad_full is not None:
            all_reduce(bucket.main_grad, group)
            r.grad.copy_(bucket.main_grad[r.offset:])
        else:
            both = torch.cat([bucket.main_grad, r.grad.to(self.device)])
            all_reduce(both, group)
            bucket.main_grad.copy_(both[:r.offset])
            r.grad.copy_(both[r.offset:])

    def zero_grad(self) -> None:
        """Nothing to zero on the host: zero 0/1's next copy overwrites each gradient whole,
        zero 2/3's next first fold copies (queued, so it follows this step's tasks)."""
        for r in self.ranges.values():
            if r.accumulate:
                r.inbound = self.worker.submit(host_range.mark_fresh, r)

    # --- accounting -------------------------------------------------------------------

    def host_bytes(self) -> int:
        """Host bytes of the offloaded state: the arena (fp32 masters, gradients, + zero 2/3's
        staging, + the model-dtype cast buffer where the model is not fp32) and the AdamW
        moments (2 fp32 a parameter, counted before the first step creates them)."""
        arena = 0 if self.arena is None else self.arena.nbytes
        return arena + sum(2 * 4 * r.main.numel() for r in self.ranges.values())

    def take_copied_bytes(self) -> Dict[str, int]:
        copied = {"d2h": self.d2h_bytes, "h2d": self.h2d_bytes}
        self.d2h_bytes = self.h2d_bytes = 0
        return copied
