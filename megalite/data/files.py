"""Open files of token shards, bounded: a corpus of thousands of shards must not exhaust the
process's open-file limit (RLIMIT_NOFILE; a memmap keeps a descriptor open per shard).

`ShardFiles` keeps at most `capacity` read-only descriptors open, closing the least recently
used one first, and reads windows with `pread` (no memory map, nothing held per shard).
`raise_open_file_limit` lifts the soft limit to the hard one at start-up, where allowed, and
`open_file_budget` is how many shard descriptors a process may keep under the (raised) limit.
"""
from __future__ import annotations

import os
import resource
from collections import OrderedDict
from typing import Tuple

import numpy as np

from megalite.data.errors import DataError

DEFAULT_OPEN_SHARDS = 16  # a ShardFiles made without a budget (tools, checks, tests)
# shard descriptors may take a quarter of the soft limit (the rest: sockets, NCCL, checkpoint
# writers, logging), within these bounds
MIN_OPEN_SHARDS, MAX_OPEN_SHARDS = 4, 4096
# where the hard limit is unlimited: Linux refuses a soft limit above fs.nr_open (2^20 default)
UNLIMITED_TARGET = 1 << 20


def raise_open_file_limit() -> Tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit where allowed; returns (before, after)
    soft limits (equal when nothing changed or the kernel refused)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


def open_file_budget() -> int:
    """How many shard descriptors this process keeps open at most: a quarter of the soft
    open-file limit, between MIN_OPEN_SHARDS and MAX_OPEN_SHARDS."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_SHARDS
    return max(MIN_OPEN_SHARDS, min(MAX_OPEN_SHARDS, soft // 4))


def open_descriptors() -> int:
    """This process's open file descriptors (entries of /proc/self/fd; Linux)."""
    return len(os.listdir("/proc/self/fd")) - 1  # less the one listing the directory


class ShardFiles:
    """Read-only descriptors of shard files, at most `capacity` open (least recently used
    closed first); one ShardFiles may serve every TokenShards of a process."""

    def __init__(self, capacity: int = DEFAULT_OPEN_SHARDS):
        if capacity < 1:
            raise ValueError(f"ShardFiles capacity={capacity}: must be at least 1")
        self.capacity = capacity
        self._open: "OrderedDict[str, int]" = OrderedDict()
        self.opened = 0  # descriptors opened so far (a miss of the cache)
        self.bytes_read = 0

    @property
    def open_count(self) -> int:
        return len(self._open)

    def _descriptor(self, path: str) -> int:
        fd = self._open.get(path)
        if fd is not None:
            self._open.move_to_end(path)
            return fd
        while len(self._open) >= self.capacity:
            _, oldest = self._open.popitem(last=False)
            os.close(oldest)
        fd = os.open(path, os.O_RDONLY)
        self._open[path] = fd
        self.opened += 1
        return fd

    def read_into(self, path: str, offset: int, out: np.ndarray) -> None:
        """Fill `out` (contiguous) with the bytes of file `path` from byte `offset`."""
        view = memoryview(out).cast("B")
        got = os.preadv(self._descriptor(path), [view], offset)
        if got != len(view):
            raise DataError(f"{path}: read {got} of {len(view)} bytes at offset {offset}: the "
                            "shard is shorter than meta.json says (changed since the run "
                            "started?); prepare the data again")
        self.bytes_read += got

    def close(self) -> None:
        while self._open:
            _, fd = self._open.popitem()
            os.close(fd)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: os may be gone
            pass
