"""Host memory pinned as counted. torch's pinned allocator (`pin_memory=True`, its caching host
allocator) rounds every block up to a power of two — a 25 MiB buffer holds 32 MiB, 12.5 MiB
holds 16 — so what megalite counts (the plan, `check_host_memory`, `HostRange.nbytes`) would
be up to half of what a rank pins. Here the bytes are allocated by the CPU allocator and their
pages registered with the driver (`cudaHostRegister`, as `torch.distributed.checkpoint` pins its
staging): the pinned bytes are the bytes asked for, rounded to whole pages.

- `HostArena`: one allocation per owner sliced into typed tensors (the offloaded optimizer
  state of a rank: `megalite.parallel.offload`), each slice starting at a multiple of ALIGN
  bytes; its `nbytes` is what the slices take with that alignment.
- `PinnedPool`: pinned byte buffers kept and reused by size in pages (the activation offload's
  host copies, `megalite.model.activation_offload`, whose sizes repeat every micro-batch): it
  holds the most bytes in use at once, not their powers of two.

A registered range starts on a page of its own and covers whole pages inside its allocation,
so no two registrations share a page. Without pinning (CPU) the same layout is one plain
allocation.
"""
from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import torch

PAGE = 4096  # bytes: the granularity of page-locking
ALIGN = 64  # bytes: where each arena slice starts (a cache line, a multiple of any dtype)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def arena_offsets(parts: Sequence[Tuple[int, torch.dtype]]) -> Tuple[List[int], int]:
    """Byte offsets of `parts` ((numel, dtype) each) laid out in order, each at a multiple of
    ALIGN, and the bytes they span."""
    offsets, end = [], 0
    for numel, dtype in parts:
        offsets.append(round_up(end, ALIGN))
        end = offsets[-1] + numel * dtype.itemsize
    return offsets, end


def _register(buf: torch.Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
    if err != 0:
        raise RuntimeError(f"pinning {buf.numel() / 2**30:.2f} GiB of host memory failed "
                           f"(cudaError {err}): the node lacks the memory, or its limit on "
                           "locked memory (ulimit -l) is lower")


def _unregister(buf: torch.Tensor) -> None:
    """Unpin `buf` once no copy can still be reading or writing it (copies are queued on side
    streams without the CPU waiting: the device is synchronized first; this runs when the
    owner goes, at the end of a run)."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def _pinned_pages(nbytes: int) -> torch.Tensor:
    """uint8 host memory of `nbytes` rounded up to whole pages, page-aligned and registered
    with the driver (the caller unregisters it: `_unregister`)."""
    span = round_up(max(nbytes, 1), PAGE)
    raw = torch.empty(span + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    buf = raw[start:start + span]
    _register(buf)
    return buf


class HostArena:
    """One host allocation holding `parts` ((numel, dtype) each) as zeroed tensors
    (`tensor(i)`), pinned exactly (`pinned`) or plain on `device` (CPU; meta for shapes)."""

    def __init__(self, parts: Sequence[Tuple[int, torch.dtype]], pinned: bool,
                 device: torch.device):
        self.parts = list(parts)
        self.offsets, self.nbytes = arena_offsets(self.parts)
        if pinned:
            pages = _pinned_pages(self.nbytes)
            weakref.finalize(self, _unregister, pages)  # when the arena goes, then its memory
            self.buffer = pages[:self.nbytes].zero_()
        else:
            self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)

    def tensor(self, i: int) -> torch.Tensor:
        """Part `i`: a typed view into the arena."""
        numel, dtype = self.parts[i]
        lo = self.offsets[i]
        return self.buffer[lo:lo + numel * dtype.itemsize].view(dtype)

    def tensors(self) -> List[torch.Tensor]:
        return [self.tensor(i) for i in range(len(self.parts))]


class PinnedPool:
    """Pinned host byte buffers reused by size in pages. `take(nbytes)` returns a buffer of
    `nbytes` and the CUDA events after which it may be written (the uses of its last holder);
    `give` takes it back with the events of its own uses. Thread-safe: buffers come back from
    wherever autograd drops them. `reserved` is the bytes pinned (every buffer, in use or
    free)."""

    def __init__(self):
        self.free: Dict[int, List[Tuple[torch.Tensor, list]]] = defaultdict(list)
        self.whole: Dict[int, torch.Tensor] = {}  # data_ptr -> the registered pages
        self.reserved = 0
        # reentrant: `give` runs from a saved block's __del__, which a garbage collection
        # started inside take/give (on this thread, holding the lock) may call
        self.lock = threading.RLock()
        weakref.finalize(self, _unregister_all, self.whole)

    def take(self, nbytes: int) -> Tuple[torch.Tensor, list]:
        span = round_up(max(nbytes, 1), PAGE)
        with self.lock:
            if self.free[span]:
                pages, after = self.free[span].pop()
                return pages[:nbytes], after
        pages = _pinned_pages(span)
        with self.lock:
            self.whole[pages.data_ptr()] = pages
            self.reserved += span
        return pages[:nbytes], []

    def give(self, buf: torch.Tensor, after: list) -> None:
        with self.lock:
            pages = self.whole[buf.data_ptr()]
            self.free[pages.numel()].append((pages, after))


def _unregister_all(whole: Dict[int, torch.Tensor]) -> None:
    for pages in whole.values():
        _unregister(pages)
