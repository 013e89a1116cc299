"""Optimizer offload (`offload.optimizer = f`): the fp32 master weights and AdamW moments of
the fraction f of this rank's owned range live in host memory (pinned on CUDA) and are
stepped there by PyTorch's CPU AdamW — ZeRO-Offload (Ren et al. 2021), Megatron-Core's
`HybridDeviceOptimizer` (a fraction offloaded), torchao's `CPUOffloadOptimizer`.

Which elements: of every bucket's owned range [lo, hi) the last round(f·(hi − lo)) elements,
[cut, hi) — so every bucket (ZeRO-3: every unit) is split alike and the host work is spread
over the whole model. The device keeps its part [lo, cut) as before; for the host part it
keeps only what the forward needs, the model-dtype parameters (and under zero 0/1 the whole
fp32 gradient it accumulates anyway; under zero 2/3 its reduced gradient shrinks to [lo, cut)).

On CUDA two streams meet: the compute stream (forward, backward, device AdamW) and one side
stream for every copy. No step ever blocks the CPU on the compute stream:

    backward   as soon as a bucket's DP reduction completes (`on_reduced`), the side stream
               waits for that reduction's own end event — not the compute stream, which is
               already running later blocks' backward — and copies the host part of the
               reduced gradient device -> host (zero 0/1: once per step, into the host
               gradient; zero 2/3: every micro-batch, into a staging buffer). Zero 2/3's host
               sums (staging added into the gradient, in the order the device adds its part,
               so the sums are the same) run on a worker thread (`_fold`), off the training
               thread: the backward hook only issues the copy and queues the fold
    grad sync  every copy landed and folded (`drain`); the tied embedding's sum and SP's TP
               sum include the host pieces (`megalite.parallel.grad_sums`)
    norm       the global norm counts host and device pieces alike; the trainer's finiteness
               verdict (train.max_bad_steps, the fp16 scaler's overflow skip) and the clip
               factor are decided before anything steps: a skipped step touches neither side
    step       the device AdamW is queued on the compute stream while the host steps range
               by range in the order the next forward uses them; each range's updated
               parameters (cast to the model dtype on the host) go host -> device on the side
               stream while the next range steps; the side stream first waits for the event
               `drain` recorded (the backward's last read of the parameters), not for the
               device AdamW. `step` returns without waiting for the copies
    next use   each block's parameters wait for their own copy, on the device, where they are
               next read (`params_needed`: a forward pre-hook on every sharding unit; before
               zero 1/2's all-gather of each bucket; before zero 3's gather of each unit), so
               the first blocks compute while the last ranges are still on the link. Zero 1/2
               with overlap_param_gather launches each bucket's gather from a stream that waits
               for that bucket's copy (`gather_after_copy`); without it the gathers are part
               of the step, so the next forward starts after the last copy

On CPU host = device: the same buffers, copies and fold thread exist (real copies between
separate tensors, no streams), which exercises the path and saves nothing. The time blocked on
copies — the CPU waiting for a fold or a copy, or on CUDA the compute stream waiting for a
parameter copy — is the step phase `offload_wait` (`megalite.train.timers`).
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from megalite.parallel.flat import Segment


def host_adamw_kind() -> str:
    """'fused' where this PyTorch has the fused CPU AdamW kernel (2.4+), else 'foreach'."""
    try:
        p = nn.Parameter(torch.zeros(1))
        torch.optim.AdamW([p], fused=True)
        return "fused"
    except (RuntimeError, TypeError):
        return "foreach"


def build_adamw(pieces: List[nn.Parameter], decays: List[bool], cfg, kind: str
                ) -> torch.optim.AdamW:
    """AdamW over `pieces` (decay / no-decay groups by `decays`), `kind` fused or foreach."""
    groups = [g for g in ({"params": [p for p, d in zip(pieces, decays) if d],
                           "weight_decay": cfg.weight_decay},
                          {"params": [p for p, d in zip(pieces, decays) if not d],
                           "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             **{kind: True})


def _host_zeros(numel: int, dtype: torch.dtype, pinned: bool, host: torch.device
                ) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=host, pin_memory=pinned)


class HostRange:
    """The offloaded part [cut, hi) of one bucket's owned range [lo, hi) in host memory."""

    def __init__(self, bucket, cut: int, pinned: bool, host: torch.device):
        self.bucket, self.cut, self.offset = bucket, cut, cut - bucket.lo
        numel = bucket.hi - cut
        self.accumulate = bucket.reduction.every_micro_batch  # zero 2/3: a sum of copies
        self.main = _host_zeros(numel, torch.float32, pinned, host)  # fp32 master weights
        self.main.copy_(bucket.main[self.offset:])
        self.grad = _host_zeros(numel, torch.float32, pinned, host)
        self.staging = _host_zeros(numel, torch.float32, pinned, host) if self.accumulate \
            else self.grad  # zero 0/1: the step's one copy lands in the gradient itself
        dtype = bucket.param_region.dtype
        self.cast = None if dtype == torch.float32 else _host_zeros(numel, dtype, pinned, host)
        self.pieces: List[nn.Parameter] = []
        self.decays: List[bool] = []
        self.optimizer: Optional[torch.optim.AdamW] = None
        self.copied_in = None  # CUDA: the event of the last copy into `staging`
        self.folding: Optional[Future] = None  # zero 2/3: the fold of that copy, queued
        self.copied_out = None  # CUDA: the event of the last copy of the parameters out

    def piece(self, seg: Segment) -> nn.Parameter:
        """The master piece of `seg` (inside [cut, hi)), its gradient in the host gradient."""
        a, b = seg.flat_lo - self.cut, seg.flat_hi - self.cut
        piece = nn.Parameter(self.main[a:b])
        piece.grad = self.grad[a:b]
        self.pieces.append(piece)
        self.decays.append(seg.spec.weight_decay)
        return piece

    def nbytes(self) -> int:
        tensors = [self.main, self.grad] + ([self.staging] if self.accumulate else []) \
            + ([self.cast] if self.cast is not None else [])
        moments = 2 * 4 * self.main.numel()  # exp_avg, exp_avg_sq (fp32)
        return sum(t.numel() * t.element_size() for t in tensors) + moments


def _fold(r: HostRange, copied) -> None:
    """The fold thread's task: once the copy into `r.staging` landed, add it to the host
    gradient (tasks run one at a time in the order queued: each range's sums keep the
    device's order)."""
    if copied is not None:
        copied.synchronize()
    r.grad.add_(r.staging)


def _wait_reduction_on(work, stream) -> bool:
    """Make `stream` wait for the collective behind `work` (a `megalite.parallel.comm`
    handle: on NCCL, `Work.wait()` blocks the *current* stream on the collective's end event,
    and blocking it a second time after the compute stream did is harmless). False for a
    group of one, whose 'reduction' ran on the compute stream. Waited through the handle, so
    a failure is a CommError naming the group and the flight recorder sees it."""
    if getattr(work, "work", None) is None:
        return False
    with torch.cuda.stream(stream):
        work.wait()
    return True


def unit_buckets(chunks, buckets) -> List[tuple]:
    """(unit, the buckets holding its parameters) for each chunk's sharding units, in forward
    order."""
    by_param = {id(p): b for b in buckets for p in b.params}
    out = []
    for chunk in chunks:
        for unit in chunk.sharding_units():
            mine: List = []
            for p in unit.parameters():
                b = by_param.get(id(p))
                if b is not None and all(b is not o for o in mine):
                    mine.append(b)
            out.append((unit, mine))
    return out


def forward_order(chunks, buckets) -> List:
    """Buckets in the order of their first use in a forward (each chunk's sharding units)."""
    order: List = []
    for _, mine in unit_buckets(chunks, buckets):
        order += [b for b in mine if all(b is not o for o in order)]
    return order + [b for b in buckets if all(b is not o for o in order)]


class OptimizerOffload:
    """One rank's offloaded optimizer state: a `HostRange` per bucket with a host part."""

    def __init__(self, chunks, buckets, fraction: float, device: torch.device, timers=None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.gather_stream = torch.cuda.Stream(device) if self.cuda else None  # zero 1/2
        self.timers = timers  # the trainer's StepTimers: waits are timed as `offload_wait`
        self.ranges: Dict[int, HostRange] = {}
        for b in buckets:
            numel = round(fraction * (b.hi - b.lo))
            if numel > 0:
                self.ranges[id(b)] = self._split(b, b.hi - numel)
        self.order = [self.ranges[id(b)] for b in forward_order(chunks, buckets)
                      if id(b) in self.ranges]
        self.d2h_bytes = 0  # copied so far (the metrics' PCIe traffic)
        self.h2d_bytes = 0
        self._folder: Optional[ThreadPoolExecutor] = None  # zero 2/3's fold thread (lazy)
        self._params_free = None  # CUDA: recorded by `drain` after the backward was queued
        # buckets whose parameter copy the device has not waited for yet (CPU: True)
        self.pending: Dict[int, object] = {}
        for unit, mine in unit_buckets(chunks, buckets):
            mine = [b for b in mine if id(b) in self.ranges]
            if mine:  # first of the unit's pre-hooks (ahead of ZeRO-3's gather)
                unit.register_forward_pre_hook(self._unit_hook(mine), prepend=True)

    def _split(self, bucket, cut: int) -> HostRange:
        host = HostRange(bucket, cut, pinned=self.cuda,  # meta: megalite-verify-rank's shapes
                         host=self.device if self.device.type == "meta" else torch.device("cpu"))
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

    def range_of(self, bucket) -> Optional[HostRange]:
        return self.ranges.get(id(bucket))

    def build_optimizers(self, cfg) -> List[torch.optim.AdamW]:
        """The host AdamW of every range with pieces (after `HostRange.piece` made them)."""
        kind = host_adamw_kind()
        for r in self.ranges.values():
            if r.pieces:
                r.optimizer = build_adamw(r.pieces, r.decays, cfg, kind)
        return [r.optimizer for r in self.ranges.values() if r.optimizer is not None]

    def _waiting(self):
        return self.timers.phase("offload_wait") if self.timers is not None \
            else contextlib.nullcontext()

    # --- gradients: device -> host ----------------------------------------------------

    def on_reduced(self, bucket, reduced: torch.Tensor, work) -> None:
        """A bucket's DP reduction completed (`reduced`: its owned range's reduced gradient,
        `work`: the reduction's handle): start copying the host part on the side stream,
        ordered after that reduction only; zero 2/3: queue its fold into the host gradient."""
        r = self.ranges.get(id(bucket))
        if r is None:
            return
        self._settle(r)  # zero 2/3: the last fold has read `staging` (long done by now)
        src = reduced[r.offset:]
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            if not _wait_reduction_on(work, self.stream):
                self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                r.staging.copy_(src, non_blocking=True)
                r.copied_in = self.stream.record_event()
            src.record_stream(self.stream)  # the compute stream may not reuse it before
        else:
            r.staging.copy_(src)
        if r.accumulate:
            if self._folder is None:
                self._folder = ThreadPoolExecutor(1, thread_name_prefix="megalite-offload")
            r.folding = self._folder.submit(_fold, r, r.copied_in)
            r.copied_in = None
        self.d2h_bytes += 4 * src.numel()

    def _settle(self, r: HostRange) -> None:
        """`r`'s last copy in has landed (and zero 2/3: been folded in); the CPU waits."""
        if r.folding is not None:
            if not r.folding.done():
                with self._waiting():
                    r.folding.result()
            r.folding, folding = None, r.folding
            folding.result()  # a failed fold raises here
        if r.copied_in is not None:
            if not r.copied_in.query():
                with self._waiting():
                    r.copied_in.synchronize()
            r.copied_in = None

    def drain(self) -> None:
        """Every copy landed and folded into the host gradients (after the step's last
        reduction); on CUDA also marks where the backward's reads of the parameters end."""
        for r in self.ranges.values():
            self._settle(r)
        if self.cuda:
            self._params_free = torch.cuda.current_stream(self.device).record_event()

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
        for r in self.ranges.values():
            self._settle(r)
            r.grad.zero_()

    # --- parameters: host step, host -> device --------------------------------------------

    def step(self) -> None:
        """Host AdamW range by range in forward order, each range's parameters sent to the
        device while the next steps; returns without waiting for the copies (the next
        reader of each bucket's parameters waits for its own: `params_needed`)."""
        if self.cuda and self._params_free is not None:
            self.stream.wait_event(self._params_free)
        for r in self.order:
            self._copied_out(r)  # the last copy has read `main` / `cast` (a step ago)
            if r.optimizer is not None:
                r.optimizer.step()
            self._to_device(r)

    def params_to_device(self) -> None:
        """The device parameters from the host masters (after a checkpoint load)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for r in self.order:
            self._copied_out(r)
            self._to_device(r)

    def copies_done(self) -> None:
        """The CPU waits until no copy reads the host masters (before a load writes them)."""
        for r in self.order:
            self._copied_out(r)

    def _copied_out(self, r: HostRange) -> None:
        if r.copied_out is not None:
            if not r.copied_out.query():
                with self._waiting():
                    r.copied_out.synchronize()
            r.copied_out = None

    def _to_device(self, r: HostRange) -> None:
        src = r.main
        if r.cast is not None:
            r.cast.copy_(r.main)
            src = r.cast
        dst = r.bucket.param_region[r.offset:]
        if self.cuda:
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                r.copied_out = self.stream.record_event()
        else:
            dst.copy_(src)
        self.pending[id(r.bucket)] = r.copied_out if self.cuda else True
        self.h2d_bytes += src.numel() * src.element_size()

    def gather_after_copy(self, bucket, gather: Callable[[], object]):
        """Zero 1/2 with parallel.overlap_param_gather: launch `bucket`'s all-gather (`gather`,
        returning its handle) ordered after the device AdamW's writes and the bucket's own
        host -> device copy, from `gather_stream`, so the compute stream does not wait for
        every copy: the next forward waits, unit by unit, for the gathers it reaches (their
        handles' `wait`). NCCL orders a collective after the stream current at its launch."""
        copied = self.pending.pop(id(bucket), None)
        if not self.cuda:
            return gather()  # CPU: the copy already happened
        self.gather_stream.wait_stream(torch.cuda.current_stream(self.device))
        if copied is not None:
            self.gather_stream.wait_event(copied)
        with torch.cuda.stream(self.gather_stream):
            return gather()

    def params_needed(self, buckets) -> None:
        """`buckets`' parameters are about to be read (a forward, a gather): on CUDA the
        current stream waits for their copies still pending — on the device, the CPU goes
        on. Each copy is waited for once; later calls find nothing pending."""
        for b in buckets:
            copied = self.pending.pop(id(b), None)
            if copied is not None and self.cuda:
                with self._waiting():
                    torch.cuda.current_stream(self.device).wait_event(copied)

    # --- accounting -------------------------------------------------------------------

    def host_bytes(self) -> int:
        """Host bytes of the offloaded state: fp32 masters, moments, gradients (+ zero 2/3's
        staging, + the model-dtype cast buffer where the model is not fp32)."""
        return sum(r.nbytes() for r in self.ranges.values())

    def take_copied_bytes(self) -> Dict[str, int]:
        copied = {"d2h": self.d2h_bytes, "h2d": self.h2d_bytes}
        self.d2h_bytes = self.h2d_bytes = 0
        return copied
