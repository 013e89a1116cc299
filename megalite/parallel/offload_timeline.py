"""Where an optimizer offload's time goes, span by span (`OptimizerOffload.record`): what
`megalite-bench offload` draws for each timed step.

    d2h        a range's gradient copy device -> host (on CUDA on the offload's side stream)
    host_step  a range's host AdamW on the worker thread (the cast to the model dtype included)
    h2d        a range's parameter copy host -> device (on CUDA on the side stream)
    wait       the training thread blocked on the offload: waiting for the worker, or on CUDA
               the compute stream waiting for a parameter copy (the `offload_wait` phase's
               spans, measured as it measures them)

Copies and waits are marked on the device's timeline (`megalite.utils.clock.DeviceClock`: CUDA
events, resolved at `take`), host steps on the host's clock (`time.perf_counter`, from the
worker thread); both are put in seconds since `begin` — on CUDA by an event recorded at
`begin` on an idle device (everything queued before it finished). Each span is labelled with
its range's index in forward order. Recording costs two marks per span; without a timeline the
offload records nothing.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, List, Tuple

import torch

from megalite.utils.clock import DeviceClock

KINDS = ("d2h", "host_step", "h2d", "wait")


class OffloadTimeline:
    def __init__(self, device: torch.device):
        self.device = device
        self.clock = DeviceClock(device)
        self._device_spans: List[Tuple[str, int, object, object]] = []
        self._host_spans: List[Tuple[str, int, float, float]] = []
        self._origin_mark = self.clock.mark()
        self._origin_host = time.perf_counter()

    def begin(self) -> None:
        """Forget every span so far and start the clock: the device has finished everything
        queued (so a CUDA origin event fires as the host's origin is taken)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._device_spans, self._host_spans = [], []
        self._origin_mark = self.clock.mark()
        if self.device.type == "cuda":
            self._origin_mark.synchronize()
        self._origin_host = time.perf_counter()

    @contextlib.contextmanager
    def on_device(self, kind: str, index: int) -> Iterator[None]:
        """A span on the current stream (CUDA) or the host's clock (CPU)."""
        start = self.clock.mark()
        yield
        self._device_spans.append((kind, index, start, self.clock.mark()))

    @contextlib.contextmanager
    def on_host(self, kind: str, index: int) -> Iterator[None]:
        """A span of the calling thread on the host's clock."""
        start = time.perf_counter()
        yield
        self._host_spans.append((kind, index, start - self._origin_host,
                                 time.perf_counter() - self._origin_host))

    def take(self) -> List[dict]:
        """Every span since `begin`, by start: {kind, range, start_s, end_s} (on CUDA this
        waits for the last mark). The caller has waited for the host step (`step_done`)."""
        spans = [{"kind": k, "range": i, "start_s": s, "end_s": e}
                 for k, i, s, e in self._host_spans]
        for kind, index, start, end in self._device_spans:
            spans.append({"kind": kind, "range": index,
                          "start_s": self.clock.seconds(self._origin_mark, start),
                          "end_s": self.clock.seconds(self._origin_mark, end)})
        self._device_spans, self._host_spans = [], []
        return sorted(spans, key=lambda s: (s["start_s"], s["end_s"]))


def totals(spans: List[dict]) -> dict:
    """Seconds of each kind's spans, summed (copies on one stream and the worker's steps do
    not overlap their own kind; waits may nest in nothing else)."""
    return {k: sum(s["end_s"] - s["start_s"] for s in spans if s["kind"] == k) for k in KINDS}
