"""ZeRO 1/2: the all-gather of the updated parameters overlapped with the next forward
(`parallel.overlap_param_gather`, Megatron's --overlap-param-gather).

After the optimizer step each DP rank holds the new values of its range only; every bucket's
all-gather brings the others' ranges. Done in the step, the next forward cannot start before
the last bucket arrived. Here the step only launches the gathers, asynchronously and in the
order the next forward uses the buckets, and every unit of the model (a chunk's
`sharding_units()`: embeddings, each block, ln_f, LM head) waits, in a forward pre-hook, for the
buckets holding its parameters. So the first block computes while the later buckets are still
on the wire (NCCL runs them on its own stream, gloo on its own threads).

With offload.optimizer a bucket whose host part is still being stepped is not gathered in the
step (that would make the step wait for every host AdamW): its gather is *deferred*, and
launched at a fixed point of the next forward, one unit ahead of its use: the forward
post-hook of the unit before the one that first reads it (after that unit's compute was
queued; the CPU waits there for the bucket's host step), or the first unit's pre-hook for
the first unit's own. The deferred ones go in forward order.
Every rank defers the same buckets (every bucket with a host part: the offloaded fraction
splits every bucket alike) and launches each at the same point of the forward — a function
of the schedule and the bucket's index only, never of whether a host thread has finished
(NCCL needs the ranks to issue their collectives on different groups — here the DP×CP
gathers and the forward's CP, TP and FP8 collectives — in one order; gloo forgives a
mismatch, `megalite.testing.collective_order` checks it).

Anything that reads the parameters outside a forward (a checkpoint, a test) calls `wait()`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch.nn as nn

from megalite.parallel.units import unit_buckets


class OverlappedParamGather:
    def __init__(self, chunks, buckets):
        self.order: List = []  # buckets in the order of their first use in a forward
        self._pending: Dict[int, object] = {}
        self._deferred: List = []  # offload.optimizer: launched one unit ahead, in order
        self._issue: Optional[Callable] = None
        units = unit_buckets(chunks, buckets)
        for _, mine in units:
            self.order += [b for b in mine if all(b is not o for o in self.order)]
        if len(self.order) != len(buckets):
            raise ValueError("overlap_param_gather: a bucket holds parameters no unit uses")
        for i, (unit, mine) in enumerate(units):
            unit.register_forward_pre_hook(self._make_pre_hook(mine))
            if i + 1 < len(units):
                unit.register_forward_hook(self._make_post_hook(units[i + 1][1]))

    def _make_pre_hook(self, buckets: List):
        def hook(module: nn.Module, args) -> None:
            self.wait(buckets)
        return hook

    def _make_post_hook(self, following: List):
        def hook(module: nn.Module, args, output) -> None:
            self._launch_deferred(following)  # the next unit's, one ahead of its use
        return hook

    def launch(self, issue: Optional[Callable[[object, Callable], object]] = None,
               later: Optional[Callable[[object], bool]] = None) -> None:
        """Start every bucket's gather (after the optimizer step), first-used first; with
        `issue`, through `issue(bucket, gather)` (offload.optimizer: ordered after the bucket's
        host copy, `OptimizerOffload.gather_after_copy`). Buckets for which `later(bucket)`
        (their host part is stepped: the same buckets on every rank) are deferred, each to the
        forward post-hook of the unit before its first use."""
        self._launch_deferred(self.order)  # (a step with no forward since the last one)
        self._issue = issue
        for bucket in self.order:
            if later is not None and later(bucket):
                self._deferred.append(bucket)
            else:
                self._start(bucket)

    def _start(self, bucket) -> None:
        def gather(b=bucket):
            return b.after_step(async_op=True)
        self._pending[id(bucket)] = gather() if self._issue is None \
            else self._issue(bucket, gather)

    def _launch_deferred(self, needed) -> None:
        """Launch the deferred gathers, in forward order, up to the last of `needed`."""
        wanted = {id(b) for b in needed}
        while self._deferred and any(id(b) in wanted for b in self._deferred):
            self._start(self._deferred.pop(0))

    def wait(self, buckets=None) -> None:
        """Block until the gathers of `buckets` (default: all) are done (launching the
        deferred ones they need first)."""
        needed = self.order if buckets is None else buckets
        self._launch_deferred(needed)
        for bucket in needed:
            work = self._pending.pop(id(bucket), None)
            if work is not None:
                work.wait()
