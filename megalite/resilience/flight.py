"""The flight recorder: each rank's last collectives, per process group (as NCCL's and
torchtitan's flight recorders keep them), for diagnosing a hang after the fact.

`megalite.parallel.comm` reports every collective it launches on a group of more than one
rank (`started`), the moment a rank begins and stops waiting for one (`waiting` / `done`),
and its failure. Per group the recorder keeps

    started    how many collectives this rank has launched there: the sequence number of the
               last one. Every member of a group launches the same collectives on it in the
               same order, so a member whose number is lower than its peers' has not arrived
    ring       the last `history` of them (op, bytes, seq, launch / end time, whether a
               thread is waiting for it now), a bounded deque: O(1) per call

Point-to-point transfers (pipeline send/recv) are counted apart (`p2p_started`, their own
sequence): the stages of a pipeline group exchange different numbers of them. Groups are
looked up by the identity of their `Group` handle (kept referenced), so a call costs one dict
lookup, one small list and a lock; no tensor is touched.

`snapshot()` is what a hang dump (`megalite.resilience.hang`) writes: every group's name,
global ranks, counters, and its ring, oldest first.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Dict, List, Optional, Sequence

# an entry's fields, in a list (cheaper than an object per collective)
SEQ, OP, NBYTES, STARTED_AT, ENDED_AT, WAITING, FAILED, PEERS = range(8)


class _Track:
    """One group's counters and ring."""

    __slots__ = ("group", "name", "ranks", "started", "p2p_started", "ring")

    def __init__(self, group, history: int):
        self.group = group  # referenced: the id() it is keyed by stays unique
        self.name, self.ranks = group.name, list(group.ranks)
        self.started = 0
        self.p2p_started = 0
        self.ring: deque = deque(maxlen=history)


class FlightRecorder:
    """The last `history` collectives of each group this rank communicates on."""

    def __init__(self, rank: int, history: int):
        if history < 1:
            raise ValueError(f"history={history}: must be >= 1 collective per group")
        self.rank, self.history = rank, history
        self.lock = threading.Lock()
        self._tracks: Dict[int, _Track] = {}
        self.on_failure = None  # called with (description, error) by `failed`; set by the
        #                         hang watch (megalite.resilience.hang)

    def started(self, op: str, group, nbytes: int,
                peers: Optional[Sequence[int]] = None) -> list:
        """A collective launched on `group` (`peers`: the global ranks of a point-to-point
        batch, None for a collective). Returns its entry, for `waiting` / `done`."""
        now = time.time()
        with self.lock:
            track = self._tracks.get(id(group))
            if track is None:
                track = self._tracks[id(group)] = _Track(group, self.history)
            if peers is None:
                track.started += 1
                seq = track.started
            else:
                track.p2p_started += 1
                seq = track.p2p_started
            entry = [seq, op, nbytes, now, None, False, False, peers]
            track.ring.append(entry)
        return entry

    @staticmethod
    def waiting(entry: list) -> None:
        """A thread of this rank blocks on the collective now."""
        entry[WAITING] = True

    @staticmethod
    def done(entry: list) -> None:
        """The collective completed on this rank."""
        entry[ENDED_AT] = time.time()
        entry[WAITING] = False

    def failed(self, entry: Optional[list], description: str, error: BaseException) -> None:
        """The collective failed or timed out (still marked waiting: the rank was waiting for
        it); the hang watch, if any, dumps."""
        if entry is not None:
            entry[FAILED] = True
        if self.on_failure is not None:
            self.on_failure(description, error)

    def snapshot(self) -> List[dict]:
        """Every group's counters and ring (oldest first), as JSON-ready dicts."""
        with self.lock:
            tracks = [(t.name, t.ranks, t.started, t.p2p_started, [list(e) for e in t.ring])
                      for t in self._tracks.values()]
        return [{"group": name, "ranks": ranks, "started": started, "p2p_started": p2p,
                 "last": [_entry_dict(e) for e in ring]}
                for name, ranks, started, p2p, ring in tracks]


def _entry_dict(e: list) -> dict:
    out = {"seq": e[SEQ], "op": e[OP], "bytes": e[NBYTES], "started_at": e[STARTED_AT],
           "ended_at": e[ENDED_AT], "waiting": e[WAITING], "failed": e[FAILED]}
    if e[PEERS] is not None:
        out["peers"] = list(e[PEERS])
    return out
