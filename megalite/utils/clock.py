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
