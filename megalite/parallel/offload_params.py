"""The parameter half of the optimizer offload (`megalite.parallel.offload`, whose docstring
tells the whole path): each range's host step queued on the worker in forward order (AdamW
with the clip folded in, the cast to the model dtype, the host -> device copy on the side
stream), and the waits for those copies where the parameters are next read (a forward, a
gather) or the host state is (checkpoints, norms). A base of `OptimizerOffload`, whose
constructor makes the state it reads (ranges in forward order, the worker, the streams, the
pending copies, the timeline)."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from megalite.parallel.host_range import HostRange


class HostParams:
    """The host step and the parameters' copies back (the fields are `OptimizerOffload`'s)."""

    def _at(self, r: HostRange) -> int:
        """`r`'s index in forward order (what a timeline labels its spans with)."""
        return self._index.get(id(r), -1) if self.timeline is not None else -1

    def _span(self, kind: str, r: HostRange, host: bool = False):
        if self.timeline is None:
            return contextlib.nullcontext()
        return (self.timeline.on_host if host else self.timeline.on_device)(kind, self._at(r))

    def step(self, coef: Optional[float], lr: float) -> None:
        """Queue each range's host step on the worker in forward order and return: AdamW
        with the gradients multiplied by `coef` (the clip factor over the loss scale; None:
        1) inside the update, the cast, the copy to the device. The next reader of each
        bucket's parameters waits for its own (`params_needed`)."""
        if self.cuda and self._params_free is not None:
            self.stream.wait_event(self._params_free)  # the backward's last read of them
        for r in self.order:
            r.stepped = self.worker.submit(self._update, r, coef, lr)
            self.pending[id(r.bucket)] = r
            self.h2d_bytes += r.main.numel() * (r.main if r.cast is None else r.cast
                                                ).element_size()

    def _update(self, r: HostRange, coef: Optional[float], lr: float) -> None:
        """The worker's host step of one range (see `step`)."""
        self._copied_out(r)  # the last copy has read `main` / `cast` (a step ago)
        opt = r.optimizer
        with self._span("host_step", r, host=True):
            if opt is not None:
                for group in opt.param_groups:
                    group["lr"] = lr
                if coef is not None and coef != 1.0 and r.fused:
                    # fused AdamW divides each gradient by grad_scale in its one pass
                    opt.grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32)
                elif coef is not None and coef != 1.0:
                    torch._foreach_mul_([p.grad for p in r.pieces], coef)
                try:
                    opt.step()
                finally:
                    opt.__dict__.pop("grad_scale", None)
        self._to_device(r)

    def params_to_device(self) -> None:
        """The device parameters from the host masters (after a checkpoint load)."""
        self.copies_done()
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for r in self.order:
            self._to_device(r)
            self.pending[id(r.bucket)] = r
            self.h2d_bytes += r.main.numel() * (r.main if r.cast is None else r.cast
                                                ).element_size()

    def step_done(self) -> None:
        """The CPU waits until the host step has finished (before reading host state)."""
        for r in self.order:
            self.worker.wait(r.stepped)

    def copies_done(self) -> None:
        """The CPU waits until no copy reads the host masters (before a load writes them)."""
        self.step_done()
        for r in self.order:
            self._copied_out(r)

    def _copied_out(self, r: HostRange) -> None:
        if r.copied_out is not None:
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
                with self._span("h2d", r):
                    dst.copy_(src, non_blocking=True)
                r.copied_out = self.stream.record_event()
        else:
            with self._span("h2d", r):
                dst.copy_(src)

    def _issued(self, r: HostRange):
        """The CPU waits until the worker issued `r`'s copy; returns its CUDA event."""
        self.worker.wait(r.stepped, self._at(r))
        return r.copied_out

    def stepping(self, bucket) -> bool:
        """Whether `bucket`'s parameter copy from the host is still to be waited for."""
        return id(bucket) in self.pending

    def gather_after_copy(self, bucket, gather: Callable[[], object]):
        """Zero 1/2 with parallel.overlap_param_gather: launch `bucket`'s all-gather (`gather`,
        returning its handle) ordered after the device AdamW's writes and the bucket's own
        host -> device copy, from `gather_stream`, so the compute stream does not wait for
        every copy: the next forward waits, unit by unit, for the gathers it reaches (their
        handles' `wait`). NCCL orders a collective after the stream current at its launch."""
        r = self.pending.pop(id(bucket), None)
        copied = None if r is None else self._issued(r)
        if not self.cuda:
            return gather()  # CPU: the copy already happened
        self.gather_stream.wait_stream(torch.cuda.current_stream(self.device))
        if copied is not None:
            self.gather_stream.wait_event(copied)
        with torch.cuda.stream(self.gather_stream):
            return gather()

    def params_needed(self, buckets) -> None:
        """`buckets`' parameters are about to be read (a forward, a gather): the CPU waits
        until the worker issued their copies still pending, then on CUDA the current stream
        waits for them — on the device, the CPU goes on. Each copy is waited for once; later
        calls find nothing pending."""
        for b in buckets:
            r = self.pending.pop(id(b), None)
            if r is None:
                continue
            copied = self._issued(r)
            if copied is not None and self.cuda:
                with self.worker.waiting(self._at(r)):
                    torch.cuda.current_stream(self.device).wait_event(copied)
