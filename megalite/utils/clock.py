"""Time marks on the device's own timeline: CUDA events on a GPU (recorded into the stream,
resolved later, so taking a mark never stalls the GPU), `time.perf_counter` on CPU. The
pipeline's F/B trace and the trainer's step phases are measured with it."""
from __future__ import annotations

import time

import torch


class DeviceClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        """Seconds from mark `start` to mark `end` (on CUDA this waits for `end`)."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


def stream_point():
    """An event recorded on the current CUDA stream now (no timing: the lighter kind): its
    `query()` says whether the stream has passed this point. What the flight recorder judges
    a CUDA collective's arrival and completion by (`megalite.parallel.calls`)."""
    e = torch.cuda.Event()
    e.record()
    return e
