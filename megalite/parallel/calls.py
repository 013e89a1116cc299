"""Launching a collective and waiting for it (`megalite.parallel.comm`'s calls go through
here): a backend failure or timeout becomes a `CommError` naming the group and op, every call
that can wait for peers is timed when the group's counter collects `waits` (straggler reports),
and reported to the counter's flight recorder when it has one (`megalite.resilience.flight`:
launched, waited for, done or failed; a failure makes the hang watch dump,
`megalite.resilience.hang`).

What the flight recorder is told of completion follows the backend's semantics, not the
return of a call. On CPU (gloo) a blocking call returns when the operation is complete, and
an asynchronous collective's `Work` reports completion. On CUDA (NCCL) a call returns once
the operation is enqueued on the GPU, and `wait()` only makes the current stream wait for it:
the recorder gets an event recorded on the current stream after the call (reached once the
operation has completed) and, before the launch, one the stream reaches when the device
arrives at it. Where the wait timing already records such a pair of events (its CUDA marks),
those are used; no event is recorded twice.
"""
from __future__ import annotations

from megalite.parallel.group import Group
from megalite.utils.clock import stream_point


class CommError(RuntimeError):
    """A collective failed or timed out (a peer died or is stuck): names the group and op."""


def _describe(op: str, group: Group) -> str:
    return f"{op} on the {group.name} group (global ranks {group.ranks})"


def run_guarded(op: str, group: Group, fn, entry=None, timed: bool = True):
    """`fn()`, timed when the group's counter collects `waits` (and `timed`); a failure or timeout
    (parallel.timeout_s) becomes a CommError that says which group was waiting, instead of an
    anonymous backend error (after the flight recorder, if any, has seen it: a hang dump)."""
    waits = group.counter.waits if timed else None
    try:
        return fn() if waits is None else waits.timed(fn)
    except RuntimeError as e:
        flight = group.counter.flight
        if flight is not None:
            flight.failed(entry, _describe(op, group), e)
        raise CommError(f"{_describe(op, group)} failed: {e}. A peer in this group crashed, "
                        "was killed or is stuck; see its log") from e


def events_around(group: Group, before):
    """On CUDA, (the event before the call just made, one after it): the wait timing's pair
    where it timed the call, else `before` and a new one."""
    waits = group.counter.waits
    if waits is not None and waits.marks:
        return waits.marks[-1]
    return before, stream_point()


def launch(op: str, group: Group, nbytes: int, fn, async_op: bool = False,
           cuda: bool = False):
    """Launch a collective, recorded by the group's flight recorder (if any); with
    `async_op`, return its `Work`. `cuda`: its tensors are on a GPU (NCCL: the call returns
    at enqueue)."""
    flight = group.counter.flight
    if flight is None:
        work = run_guarded(op, group, fn)
        return Work(work, op, group, None, cuda) if async_op else work
    entry = flight.started(op, group, nbytes)
    if not async_op:
        flight.waiting(entry)
    before = stream_point() if cuda and group.counter.waits is None else None
    work = run_guarded(op, group, fn, entry)
    if cuda:
        before, after = events_around(group, before)
        flight.arrives_when(entry, before)
        flight.complete_when(entry, work if async_op else after)
    elif async_op:
        flight.complete_when(entry, work)  # gloo's collective works report completion
    else:
        flight.done(entry)
    return Work(work, op, group, entry, cuda) if async_op else work


class Work:
    """An asynchronous collective's handle; `wait()` raises CommError naming the group."""

    __slots__ = ("work", "op", "group", "entry", "cuda")

    def __init__(self, work, op: str, group: Group, entry=None, cuda: bool = False):
        self.work, self.op, self.group, self.entry, self.cuda = work, op, group, entry, cuda

    def wait(self) -> bool:
        return wait_for(self.op, self.group, self.work.wait, self.entry, self.cuda)


def wait_for(op: str, group: Group, wait, entry=None, cuda: bool = False):
    """Wait for a launched operation (`wait()`), recorded in its flight-recorder `entry`: on
    CPU it is done when the wait returns; on CUDA when the current stream passes the point
    after the wait (the probe that replaces the operation's Work, which holds its tensors)."""
    flight = group.counter.flight
    if flight is None or entry is None:
        return run_guarded(op, group, wait)
    flight.waiting(entry)
    before = stream_point() if cuda and group.counter.waits is None else None
    result = run_guarded(op, group, wait, entry)
    if cuda:
        flight.complete_when(entry, events_around(group, before)[1])
    else:
        flight.done(entry)
    return result


class Done:
    """The handle of a collective that needed no communication (a group of one)."""

    def wait(self) -> bool:
        return True
