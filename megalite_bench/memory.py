"""Peak live tensor bytes of a piece of code, on the CPU as on a GPU: what the memory plan
(`megalite.plan.memory`) is held to.

    base = live_tensor_bytes()    # what is alive before (found through the collector)
    with PeakBytes(device) as peak:
        ...                       # a training step
    base + peak.bytes             # the step's peak live tensor bytes

CPU: torch.profiler with `profile_memory=True` records every allocation and free of the CPU
allocator (`c10::ProfiledCPUMemoryReporter`, each event with its size and address) made on
the threads it watches — the calling thread and those it hands work to (autograd's); replaying
them in time order gives the live bytes after each event, and their maximum. A free on
another thread is not seen (torch 2.13's `profile_all_threads` records no memory events at
all), and its tensor counts as alive until its address is allocated again: gloo's worker
thread sometimes drops the last reference to a finished collective's tensors (its input, its
copy of it) when the caller waited for it right after the launch, as a step's last gradient
reduction is; such a run over-counts by those tensors. Only allocations
made inside the block count (a free of an older tensor is not reported, and is ignored), so
`bytes` is exact for what the block allocates — tensors only: not the Python heap, not
library workspaces (oneDNN, OpenMP). CUDA: the caching allocator's `max_memory_allocated`
over the block minus what was allocated at its start (the same quantity: bytes of live
tensors, rounded up to the allocator's 512-byte blocks).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch


class PeakBytes:
    """Context manager: `bytes` = the most bytes of tensors allocated inside it and alive at
    once; `timeline` (CPU) = (ns, live bytes) after each allocation or free."""

    def __init__(self, device: Optional[torch.device] = None):
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.bytes = 0
        self.timeline: List[Tuple[int, int]] = []
        self._prof = None
        self._base = 0

    def __enter__(self) -> "PeakBytes":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.timeline = _replay(self._prof)
            self.bytes = max((b for _, b in self.timeline), default=0)
        self._prof = None


def _replay(prof) -> List[Tuple[int, int]]:
    """(ns, live bytes) after each CPU allocation event of `prof`, in time order."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        if ev.typed[0] == _EventType.Allocation:
            alloc = ev.typed[1]
            if alloc.device.type == "cpu":
                events.append((ev.start_time_ns, alloc.alloc_size, alloc.ptr))
        stack.extend(ev.children)
    events.sort(key=lambda e: (e[0], e[1] > 0))  # a free before an allocation at a tie
    live, total, timeline = {}, 0, []
    for ns, size, ptr in events:
        if size > 0:
            total += size - live.get(ptr, 0)
            live[ptr] = size
        elif ptr in live:  # a free of a block allocated inside
            total -= live.pop(ptr)
        timeline.append((ns, total))
    return timeline


def live_storages(device: Optional[torch.device] = None) -> Dict[int, int]:
    """{address: bytes} of the distinct storages of every tensor alive now on `device` (the
    CPU by default), found through Python's garbage collector after a collection."""
    import gc

    from torch._subclasses.fake_tensor import is_fake  # no memory of their own; their
    # storage has no data pointer (a FakeTensor a tracer or DCP's planner left alive)

    device = torch.device("cpu") if device is None else torch.device(device)
    gc.collect()
    storages: Dict[int, int] = {}
    for obj in gc.get_objects():
        # type(): isinstance would read __class__, which some of the collector's objects
        # warn on
        if issubclass(type(obj), torch.Tensor) and obj.device.type == device.type \
                and not obj.is_meta and not is_fake(obj):
            try:
                storage = obj.untyped_storage()
                address = storage.data_ptr()
            except RuntimeError:  # no data pointer (a tracer's wrapper): no memory to count
                continue
            storages[address] = max(storage.nbytes(), storages.get(address, 0))
    return storages


def live_tensor_bytes(device: Optional[torch.device] = None,
                      before: Optional[Dict[int, int]] = None) -> int:
    """Bytes of the tensors alive now on `device` (`live_storages`; CUDA: the caching
    allocator's `memory_allocated`), less those already alive in `before` (a
    `live_storages()` taken earlier: what the process held before the measured run was
    built): the baseline of a step whose own peak `PeakBytes` measures. At a step's boundary
    every tensor of a run (parameters, flat buffers, optimizer state) is reachable from
    Python."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    before = before or {}
    return sum(n for ptr, n in live_storages(device).items() if ptr not in before)
