"""Optimizer offload (`offload.optimizer = f`): the fp32 master weights and AdamW moments of
the fraction f of this rank's owned range live in host memory (pinned on CUDA) and are
stepped there by PyTorch's CPU AdamW — ZeRO-Offload (Ren et al. 2021), Megatron-Core's
`HybridDeviceOptimizer` (a fraction offloaded), torchao's `CPUOffloadOptimizer`.

Which elements: of every bucket's owned range [lo, hi) the last round(f·(hi − lo)) elements,
[cut, hi) — so every bucket (ZeRO-3: every unit) is split alike and the host work is spread
over the whole model. The device keeps its part [lo, cut) as before; for the host part it
keeps only what the forward needs, the model-dtype parameters (and under zero 0/1 the whole
fp32 gradient it accumulates anyway; under zero 2/3 its reduced gradient shrinks to [lo, cut)).

    backward   as soon as a bucket's DP reduction completes (`ZeroEngine.bucket_reduced`): its
               reduced gradient of [cut, hi) goes device -> host on a side stream (zero 0/1:
               once per step; zero 2/3: every micro-batch, added on the host in the order the
               device adds its part, so the sums are the same); the previous copy of the same
               bucket is folded in first
    grad sync  every copy folded in (`drain`); the TP sum of SP's TP-replicated pieces and the
               tied embedding's sum include the host pieces (`ZeroEngine.finish_grad_sync`)
    norm       the global norm counts host and device pieces alike; the trainer's finiteness
               verdict (train.max_bad_steps, the fp16 scaler's overflow skip) and the clip
               factor are decided before anything steps: a skipped step touches neither side
    step       the device AdamW steps its pieces (asynchronously on CUDA) while the host
               steps bucket by bucket in the order the next forward uses them; each bucket's
               updated parameters (cast to the model dtype on the host) go host -> device on
               the side stream while the next bucket steps; before the step returns the
               compute stream waits for the last copy, so every block's parameters are in
               place before the next forward (and before zero 1/2's all-gather) reads them

On CPU host = device: the same buffers and copies exist (real copies between separate
tensors, no streams), which exercises the path and saves nothing. The time blocked on copies
is the step phase `offload_wait` (`megalite.train.timers`; part of grad_sync / optimizer).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

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
        self.d2h = None  # a copy into `staging` not folded in yet (CUDA: its event)
        self.h2d = None  # CUDA: the event of the last copy of the parameters to the device

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


def forward_order(chunks, buckets) -> List:
    """Buckets in the order of their first use in a forward (each chunk's sharding units)."""
    by_param = {id(p): b for b in buckets for p in b.params}
    order: List = []
    for chunk in chunks:
        for unit in chunk.sharding_units():
            for p in unit.parameters():
                bucket = by_param.get(id(p))
                if bucket is not None and all(bucket is not o for o in order):
                    order.append(bucket)
    return order + [b for b in buckets if all(b is not o for o in order)]


class OptimizerOffload:
    """One rank's offloaded optimizer state: a `HostRange` per bucket with a host part."""

    def __init__(self, chunks, buckets, fraction: float, device: torch.device):
        self.fraction, self.device = fraction, device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.timers = None  # the trainer's StepTimers: waits are timed as `offload_wait`
        self.ranges: Dict[int, HostRange] = {}
        for b in buckets:
            numel = round(fraction * (b.hi - b.lo))
            if numel > 0:
                self.ranges[id(b)] = self._split(b, b.hi - numel)
        self.order = [self.ranges[id(b)] for b in forward_order(chunks, buckets)
                      if id(b) in self.ranges]
        self.d2h_bytes = 0  # copied so far (the metrics' PCIe traffic)
        self.h2d_bytes = 0

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

    def on_reduced(self, bucket, reduced: torch.Tensor) -> None:
        """A bucket's DP reduction completed (`reduced`: its owned range's reduced gradient):
        start copying the host part (after folding in the previous copy)."""
        r = self.ranges.get(id(bucket))
        if r is None:
            return
        self._fold(r)
        src = reduced[r.offset:]
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                r.staging.copy_(src, non_blocking=True)
                r.d2h = self.stream.record_event()
            src.record_stream(self.stream)
        else:
            r.staging.copy_(src)
            r.d2h = True
        self.d2h_bytes += 4 * src.numel()

    def _fold(self, r: HostRange) -> None:
        if r.d2h is None:
            return
        if self.cuda and not r.d2h.query():
            with self._waiting():
                r.d2h.synchronize()
        if r.accumulate:
            r.grad.add_(r.staging)
        r.d2h = None

    def drain(self) -> None:
        """Every copy folded into the host gradients (after the step's last reduction)."""
        for r in self.ranges.values():
            self._fold(r)

    def all_reduce_host(self, bucket, group, all_reduce) -> None:
        """`all_reduce` of a bucket's host gradient (the tied embedding's sum): through the
        device where the backend needs device tensors."""
        r = self.ranges.get(id(bucket))
        if r is None:
            return
        on_device = r.grad.to(self.device)
        all_reduce(on_device, group)
        r.grad.copy_(on_device)

    def zero_grad(self) -> None:
        for r in self.ranges.values():
            r.grad.zero_()

    # --- parameters: host step, host -> device --------------------------------------------

    def step(self) -> None:
        """Host AdamW bucket by bucket in forward order, each bucket's parameters sent to the
        device while the next steps; returns once the compute stream waits for them all."""
        for r in self.order:
            if r.optimizer is not None:
                r.optimizer.step()
            self._to_device(r)
        self._settle()

    def params_to_device(self) -> None:
        """The device parameters from the host masters (after a checkpoint load)."""
        for r in self.order:
            self._to_device(r)
        self._settle()

    def _to_device(self, r: HostRange) -> None:
        src = r.main
        if r.cast is not None:
            if r.h2d is not None:
                r.h2d.synchronize()  # the last step's copy has read the cast buffer
            r.cast.copy_(r.main)
            src = r.cast
        dst = r.bucket.param_region[r.offset:]
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                r.h2d = self.stream.record_event()
        else:
            dst.copy_(src)
        self.h2d_bytes += src.numel() * src.element_size()

    def _settle(self) -> None:
        if not self.cuda or not self.order:
            return
        with self._waiting():  # the copies run in order on one stream: the last is the end
            self.order[-1].h2d.synchronize()
        current = torch.cuda.current_stream(self.device)
        for r in self.order:
            current.wait_event(r.h2d)

    # --- accounting -------------------------------------------------------------------

    def host_bytes(self) -> int:
        """Host bytes of the offloaded state: fp32 masters, moments, gradients (+ zero 2/3's
        staging, + the model-dtype cast buffer where the model is not fp32)."""
        return sum(r.nbytes() for r in self.ranges.values())

    def take_copied_bytes(self) -> Dict[str, int]:
        copied = {"d2h": self.d2h_bytes, "h2d": self.h2d_bytes}
        self.d2h_bytes = self.h2d_bytes = 0
        return copied
