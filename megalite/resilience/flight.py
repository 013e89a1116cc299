"""The flight recorder: each rank's last collectives, per process group (as NCCL's and
torchtitan's flight recorders keep them), for diagnosing a hang after the fact and for seeing
one coming.

`megalite.parallel.calls` reports every collective, point-to-point batch and object
collective it launches on a group of more than one rank (`started`), the moment a thread
begins waiting for one (`waiting`) and what it knows of its completion: a host call that
returned where the host blocks until completion (gloo; object collectives; `done`), or a
*probe* it leaves behind where the host does not (`complete_when`: an asynchronous
operation's `Work` until it is waited for; on CUDA an event recorded on the current stream
after the wait, which the stream reaches once the collective is complete). NCCL's
collectives return at enqueue and complete later on the stream; the watch thread
(`megalite.resilience.hang`) looks at the probes (`poll`), so an operation counts as done when
it has completed, never when its launch or its wait returned.

Per group the recorder keeps

    started      how many collectives this rank has launched there: the sequence number of the
                 last one. Every member of a group launches the same collectives on it in the
                 same order, so a member whose number is lower than its peers' has not arrived
    ring         the last `history` of them, a bounded deque: O(1) per call
    pinned       entries pushed out of the ring while not complete (at most `history`,
                 oldest dropped first), kept until they complete (a failed one stays): a stuck
                 collective stays judged and counted behind hundreds of later ones

and per point-to-point batch (pipeline send/recv, their own sequence `p2p_started`, since the
stages of a pipeline exchange different numbers of them) how many batches this rank has
posted with each peer (`p2p_with`): the n-th batch between two stages is the same transfer
round on both.

An entry's states (a list of fields, cheaper than an object per operation):

    launched ──(CUDA: its arrival event fires)──> arrived ──> done
        │  (on CPU a launch is an arrival)            │
        │                                            └──> failed (the call raised, or its
        │                                                 probe's Work ended with an error)
        └── not done `hang_after_s` after its launch, its group's threshold: stuck
            (reported once by `poll`; the hang watch dumps; if it completes after all the
            watch turns that dump into a live one)

`arrived`: on CUDA the device reached the point where the operation was launched (an event
recorded on the current stream before the launch, whose firing NCCL's stream waits for); a
rank whose CPU ran ahead but whose stream is stuck in a kernel has launched the collective
without arriving at it. On CPU launching is arriving.

Judged for stuck: entries with a probe, and entries a thread is waiting for. gloo's
point-to-point works report completion only once waited for, and its waits block the host, so
a posted gloo batch nobody waits for yet is not judged (it cannot be told from a completed
one) until a thread waits for it. Groups are looked up by the identity of their `Group`
handle (kept referenced): a call costs one dict lookup, one small list and a lock; no tensor is
touched. A probe is dropped once it has fired (it holds the operation's tensors).

`snapshot()` is what a hang dump writes: every group's name, global ranks, counters (started,
arrived, completed: the sequence number up to which every collective has completed), its
point-to-point counters, and its ring, oldest first.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

# an entry's fields, in a list (cheaper than an object per collective)
(SEQ, OP, NBYTES, STARTED_AT, ENDED_AT, WAITING, FAILED, PEERS, PROBE, ARRIVAL, STUCK,
 ERROR) = range(12)


def fired(probe) -> bool:
    """Whether a completion probe reports an end: a torch `Work` (`is_completed`), a CUDA
    event (`query`), or a list of them (all). NCCL's `isCompleted` is true for an errored or
    timed-out work too (`exception() || finishedGPUExecution`): see `probe_error`."""
    if isinstance(probe, list):
        return all(fired(p) for p in probe)
    query = getattr(probe, "is_completed", None) or probe.query
    return bool(query())


def probe_error(probe) -> Optional[str]:
    """Of a probe that fired: the error of its `Work` (or of the first of a list's works)
    whose `exception()` is set — a failed or timed-out NCCL collective, which `is_completed`
    reports as ended — or whose `exception()` raises; None for a completion."""
    for p in (probe if isinstance(probe, list) else [probe]):
        if getattr(p, "is_completed", None) is None:
            continue  # a CUDA event: no error to read
        try:
            error = p.exception()
        except Exception as e:  # noqa: BLE001 - a work that cannot say is not a success
            return f"its Work's exception() raised {e!r}"
        if error is not None:
            return str(error)
    return None


def look(probe) -> Tuple[bool, Optional[str]]:
    """(whether `probe` fired, the error it ended with): a probe whose query raises (a
    sticky CUDA error) has ended, failed — one look never raises."""
    try:
        if not fired(probe):
            return False, None
    except Exception as e:  # noqa: BLE001 - judged, not raised: the watch goes on
        return True, f"its probe raised {e!r}"
    return True, probe_error(probe)


def _ended_by_now(entry: list, now: float) -> bool:
    """Whether an entry leaving the ring has ended: marked so, or its probe has fired without
    an error (an asynchronous collective is marked only when the watch polls, so most of those
    leaving the ring between two polls are complete, not stuck)."""
    if entry[ENDED_AT] is not None:
        return True
    probe = entry[PROBE]
    if probe is None or entry[FAILED]:
        return False
    ended, error = look(probe)
    if ended and error is None:
        entry[PROBE], entry[ARRIVAL], entry[ENDED_AT] = None, None, now
        return True
    return False


def _pin(track: "_Track", entry: list) -> None:
    """Keep an incomplete entry out of the ring. A full pin list lets go of its ended entries
    first; if every one is still incomplete, the oldest stay (a stuck collective is the oldest
    incomplete one of its group) and this one is not kept."""
    pinned = track.pinned
    if len(pinned) == pinned.maxlen:
        pinned = track.pinned = deque((e for e in pinned if e[ENDED_AT] is None),
                                      maxlen=pinned.maxlen)
    if len(pinned) < pinned.maxlen:
        pinned.append(entry)


class _Track:
    """One group's counters and ring."""

    __slots__ = ("group", "name", "ranks", "started", "p2p_started", "p2p_with", "ring",
                 "pinned", "hang_after_s")

    def __init__(self, group, history: int, hang_after_s: Optional[float]):
        self.group = group  # referenced: the id() it is keyed by stays unique
        self.name, self.ranks = group.name, list(group.ranks)
        self.started = 0
        self.p2p_started = 0
        self.p2p_with: Dict[int, int] = {}
        self.ring: deque = deque(maxlen=history)
        self.pinned: deque = deque(maxlen=history)
        self.hang_after_s = hang_after_s

    def entries(self) -> list:
        """The pinned entries and the ring's, oldest first (the caller holds the lock); a
        pinned entry is let go once it completed."""
        if self.pinned:
            self.pinned = deque((e for e in self.pinned if e[ENDED_AT] is None),
                                maxlen=self.pinned.maxlen)
        return list(self.pinned) + list(self.ring)


class FlightRecorder:
    """The last `history` collectives of each group this rank communicates on.

    `hang_after_s`: how long an operation may stay incomplete before `poll` reports it stuck
    (None: never), per group name in `thresholds` where a group has its own (the checkpoint
    group's longer timeout)."""

    def __init__(self, rank: int, history: int, hang_after_s: Optional[float] = None,
                 thresholds: Optional[Mapping[str, float]] = None):
        if history < 1:
            raise ValueError(f"history={history}: must be >= 1 collective per group")
        self.rank, self.history = rank, history
        self.hang_after_s = hang_after_s
        self.thresholds = dict(thresholds or {})
        self.lock = threading.Lock()
        self._tracks: Dict[int, _Track] = {}
        self.on_failure = None  # called with (description, error) by `failed`; set by the
        #                         hang watch (megalite.resilience.hang)

    def _track(self, group) -> _Track:
        track = self._tracks.get(id(group))
        if track is None:
            track = self._tracks[id(group)] = _Track(
                group, self.history, self.thresholds.get(group.name, self.hang_after_s))
        return track

    def started(self, op: str, group, nbytes: int, peers: Optional[Sequence[int]] = None,
                arrival=None) -> list:
        """An operation launched on `group` (`peers`: the global ranks of a point-to-point
        batch, None for a collective; `arrival`: on CUDA, an event recorded on the current
        stream before the launch). Returns its entry, for `waiting` / `done` /
        `complete_when`."""
        now = time.time()
        with self.lock:
            track = self._track(group)
            if peers is None:
                track.started += 1
                seq, peer_seq = track.started, None
            else:
                track.p2p_started += 1
                seq, with_ = track.p2p_started, track.p2p_with
                peer_seq = {}
                for p in peers:
                    peer_seq[p] = with_[p] = with_.get(p, 0) + 1
            entry = [seq, op, nbytes, now, None, False, False, peer_seq, None, arrival, False,
                     None]
            ring = track.ring
            if len(ring) == ring.maxlen and not _ended_by_now(ring[0], now):
                _pin(track, ring[0])  # not complete (or failed): kept out of the ring
            ring.append(entry)
        return entry

    @staticmethod
    def waiting(entry: list) -> None:
        """A thread of this rank blocks on the operation now."""
        entry[WAITING] = True

    @staticmethod
    def done(entry: list) -> None:
        """The operation completed on this rank (the host saw it: a blocking call returned)."""
        entry[ENDED_AT] = time.time()
        entry[WAITING] = False
        entry[PROBE] = entry[ARRIVAL] = None

    @staticmethod
    def complete_when(entry: list, probe) -> None:
        """The operation completes when `probe` fires (its Work, a CUDA event after it, or a
        list of them): the host did not see it complete. No thread waits for it any more."""
        entry[WAITING] = False
        entry[PROBE] = probe

    @staticmethod
    def arrives_when(entry: list, event) -> None:
        """On CUDA: the device arrives at the operation when `event` (recorded on the current
        stream before its launch) fires."""
        entry[ARRIVAL] = event

    def failed(self, entry: Optional[list], description: str, error: BaseException) -> None:
        """The operation failed or timed out (still marked waiting: the rank was waiting for
        it); the hang watch, if any, dumps."""
        if entry is not None:
            entry[FAILED], entry[ERROR] = True, str(error)
            entry[PROBE] = None
        if self.on_failure is not None:
            self.on_failure(description, error)

    def poll(self, now: float) -> List[Tuple[str, List[int], float, list]]:
        """One look (the hang watch's thread): entries whose probe has fired are done, or
        failed where the probe's Work holds an error (`probe_error`: FAILED set, the error in
        ERROR); returns the operations newly stuck or newly failed — (group name, global
        ranks, its threshold, entry), oldest first — each reported once."""
        with self.lock:
            tracks = [(t.name, t.ranks, t.hang_after_s, t.entries())
                      for t in self._tracks.values()]
        stuck = []
        for name, ranks, threshold, ring in tracks:
            for e in ring:
                if e[ENDED_AT] is not None or e[FAILED]:
                    continue
                probe = e[PROBE]
                ended, error = (False, None) if probe is None else look(probe)
                if ended:
                    e[PROBE], e[ARRIVAL] = None, None
                    if error is None:
                        e[ENDED_AT] = now
                    else:
                        e[FAILED], e[ERROR] = True, error
                        stuck.append((name, ranks, threshold, e))
                    continue
                arrival = e[ARRIVAL]
                if arrival is not None and look(arrival)[0]:
                    e[ARRIVAL] = None
                judged = probe is not None or e[WAITING]
                if (judged and threshold is not None and not e[STUCK]
                        and now - e[STARTED_AT] > threshold):
                    e[STUCK] = True
                    stuck.append((name, ranks, threshold, e))
        stuck.sort(key=lambda s: s[3][STARTED_AT])
        return stuck

    def snapshot(self) -> List[dict]:
        """Every group's counters and ring (oldest first), as JSON-ready dicts."""
        with self.lock:
            tracks = [(t.name, t.ranks, t.started, t.p2p_started, dict(t.p2p_with),
                       t.entries()) for t in self._tracks.values()]
        out = []
        for name, ranks, started, p2p, with_, ring in tracks:
            arrived, completed = started, started
            for e in ring:  # collectives complete and arrive in order on a group
                if e[PEERS] is not None:
                    continue
                arrival = e[ARRIVAL]
                if e[ENDED_AT] is None:
                    completed = min(completed, e[SEQ] - 1)
                    if arrival is not None and not look(arrival)[0]:
                        arrived = min(arrived, e[SEQ] - 1)
            out.append({"group": name, "ranks": ranks, "started": started, "arrived": arrived,
                        "completed": completed, "p2p_started": p2p,
                        "p2p_with": {str(p): n for p, n in sorted(with_.items())},
                        "last": [_entry_dict(e) for e in ring]})
        return out


def _entry_dict(e: list) -> dict:
    out = {"seq": e[SEQ], "op": e[OP], "bytes": e[NBYTES], "started_at": e[STARTED_AT],
           "ended_at": e[ENDED_AT], "waiting": e[WAITING], "failed": e[FAILED],
           "stuck": e[STUCK]}
    if e[ERROR] is not None:
        out["error"] = e[ERROR]
    if e[PEERS] is not None:
        out["peers"] = sorted(e[PEERS])
        out["peer_seq"] = {str(p): n for p, n in sorted(e[PEERS].items())}
    return out
