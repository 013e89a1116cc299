"""Time marks on the device's own timeline: CUDA events on a GPU (recorded into the stream,
resolved later, so taking a mark never stalls the GPU), `time.perf_counter` on CPU. The
pipeline's F/B trace and the trainer's step phases are measured with it."""
from __future__ import annotations

import time
from typing import Optional

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


def thread_cuda_device() -> Optional[int]:
    """The CUDA device the calling thread works on, where this process has initialised CUDA;
    None otherwise (asking initialises nothing)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def bind_cuda_device(index: Optional[int]) -> None:
    """Make device `index` (from `thread_cuda_device`) the calling thread's CUDA device. A new
    thread starts on device 0, and its first CUDA call (an event query, an event's destruction)
    would create a context there: ~0.5 GiB of GPU 0 for every rank of a node whose device is
    another (the leak torchcomms' NCCL watchdog fixed the same way, meta-pytorch/torchcomms#777)."""
    if index is not None:
        torch.cuda.set_device(index)
