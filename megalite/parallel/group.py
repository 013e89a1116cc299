"""Process groups as megalite passes them around, and what their calls are counted in.

A `Group` is one process group this rank belongs to (its name, global ranks, this rank's index
and the torch handle); a `CommCounter` (one per `Topology`) counts the bytes of every call made
on its groups (`megalite.parallel.comm`), times the calls that can wait for peers when
`waits` is set (straggler reports) and reports each call to `flight` when set (the flight
recorder of the hang dumps, `megalite.resilience.flight`).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0  # payload bytes
    wire_bytes: float = 0.0  # ring bytes sent by this rank


class CollectiveWaits:
    """Time spent in every call of the training thread that can wait for peers: the time a
    rank spends there is not its own compute (a slow peer makes it long). Taken on the
    device's timeline (`megalite.utils.clock`): on CUDA a pair of events in the current stream,
    which waits for the collective there, so a pair measures the stream's stall — kept in
    `marks` until `StepTimers` resolves them; on CPU (gloo) the host blocks in the call, and
    the seconds add up at once (no object kept per call). Launching an asynchronous
    collective is timed too (it returns at once)."""

    def __init__(self, clock):
        self.clock = clock
        self.marks: List[Tuple[object, object]] = []  # CUDA: events not yet resolved
        self.seconds = 0.0  # CPU: the total so far
        self.calls = 0

    def timed(self, fn):
        start = self.clock.mark()
        try:
            return fn()
        finally:
            end = self.clock.mark()
            self.calls += 1
            if self.clock.cuda:
                self.marks.append((start, end))
            else:
                self.seconds += end - start

    def position(self):
        """Where the record stands now (for `between`)."""
        return len(self.marks) if self.clock.cuda else self.seconds

    def between(self, first, last) -> float:
        """Seconds waited between two positions (on CUDA: waits for the events)."""
        if not self.clock.cuda:
            return last - first
        return sum(self.clock.seconds(a, b) for a, b in self.marks[first:last])

    def clear(self) -> None:
        """Forget the marks (positions taken before are void on CUDA)."""
        self.marks.clear()


@dataclass
class CommCounter:
    """Byte counters keyed by (group name, op); with `waits`, the time spent in the calls."""

    stats: Dict[Tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    # a background checkpoint thread records too (on the checkpoint group's own counter,
    # which never times waits)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    waits: Optional[CollectiveWaits] = field(default=None, repr=False, compare=False)
    flight: Optional[object] = field(default=None, repr=False, compare=False)  # FlightRecorder

    def record(self, group: str, op: str, payload: int, wire: float, calls: int = 1) -> None:
        with self.lock:
            s = self.stats[(group, op)]
            s.calls += calls
            s.bytes += payload
            s.wire_bytes += wire

    def snapshot(self) -> Dict[str, Dict[str, float]]:
        """{"<group>/<op>": {"calls", "bytes", "wire_bytes"}} — cumulative since creation."""
        with self.lock:
            return {f"{g}/{op}": {"calls": s.calls, "bytes": s.bytes,
                                  "wire_bytes": s.wire_bytes}
                    for (g, op), s in sorted(self.stats.items())}

    @staticmethod
    def delta(new: Dict[str, Dict[str, float]], old: Dict[str, Dict[str, float]]
              ) -> Dict[str, Dict[str, float]]:
        """Counts between two snapshots (e.g. over one logging interval)."""
        out = {}
        for key, cur in new.items():
            prev = old.get(key, {})
            out[key] = {k: v - prev.get(k, 0) for k, v in cur.items()}
        return out


@dataclass
class Group:
    """A process group this rank belongs to, with its name and the counter to report to."""

    name: str
    ranks: List[int]
    rank: int  # this process's index inside the group
    pg: Optional[dist.ProcessGroup]
    counter: CommCounter

    @property
    def size(self) -> int:
        return len(self.ranks)


def single_rank_group(name: str) -> Group:
    """A group of this process alone: what a model built outside any layout communicates
    over (nothing; every collective on it is a no-op)."""
    return Group(name=name, ranks=[0], rank=0, pg=None, counter=CommCounter())
