"""Launching a collective and waiting for it (`megalite.parallel.comm`'s calls go through
here): a backend failure or timeout becomes a `CommError` naming the group and op, every call
that can wait for peers is timed when the group's counter collects `waits` (straggler reports),
and reported to the counter's flight recorder when it has one (`megalite.resilience.flight`:
launched, waited for, done or failed; a failure makes the hang watch dump,
`megalite.resilience.hang`).
"""
from __future__ import annotations

from megalite.parallel.group import Group


class CommError(RuntimeError):
    """A collective failed or timed out (a peer died or is stuck): names the group and op."""


def _describe(op: str, group: Group) -> str:
    return f"{op} on the {group.name} group (global ranks {group.ranks})"


def call(op: str, group: Group, fn, entry=None, blocking: bool = True):
    """Run a collective; a failure or timeout (parallel.timeout_s) becomes a CommError that
    says which group was waiting, instead of an anonymous backend error (after the flight
    recorder, if any, has seen it: a hang dump). Timed when the group's counter collects
    `waits`. `entry`: the flight recorder's record of the collective, waited for here when
    `blocking` (not when only launching an asynchronous one)."""
    waits, flight = group.counter.waits, group.counter.flight
    recorded = flight is not None and entry is not None and blocking
    if recorded:
        flight.waiting(entry)
    try:
        result = fn() if waits is None else waits.timed(fn)
    except RuntimeError as e:
        if flight is not None:
            flight.failed(entry, _describe(op, group), e)
        raise CommError(f"{_describe(op, group)} failed: {e}. A peer in this group crashed, "
                        "was killed or is stuck; see its log") from e
    if recorded:
        flight.done(entry)
    return result


def launch(op: str, group: Group, nbytes: int, fn, async_op: bool = False):
    """Launch a collective through `call`, recorded by the group's flight recorder (if any);
    with `async_op`, return its `Work`."""
    flight = group.counter.flight
    entry = None if flight is None else flight.started(op, group, nbytes)
    work = call(op, group, fn, entry, blocking=not async_op)
    return Work(work, op, group, entry) if async_op else work


class Work:
    """An asynchronous collective's handle; `wait()` raises CommError naming the group."""

    def __init__(self, work, op: str, group: Group, entry=None):
        self.work, self.op, self.group, self.entry = work, op, group, entry

    def wait(self) -> bool:
        return call(self.op, self.group, self.work.wait, self.entry)


class Done:
    """The handle of a collective that needed no communication (a group of one)."""

    def wait(self) -> bool:
        return True
