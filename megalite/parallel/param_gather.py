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
step (that would make the step wait for every host AdamW): its gather is *deferred* and
launched by the pre-hook of its first unit — the deferred ones always in forward order, and
at each pre-hook the next ones whose host step has finished, so they are on the wire before
they are needed.
Every rank defers the same buckets and launches them in the same order between the same
collectives of the group (a forward issues none on the DP group), so the collectives match.

Anything that reads the parameters outside a forward (a checkpoint, a test) calls `wait()`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch.nn as nn


class OverlappedParamGather:
    def __init__(self, chunks, buckets):
        by_param = {id(p): b for b in buckets for p in b.params}
        self.order: List = []  # buckets in the order of their first use in a forward
        self._pending: Dict[int, object] = {}
        self._deferred: List = []  # offload.optimizer: launched where first needed, in order
        self._issue: Optional[Callable] = None
        self._ready: Optional[Callable] = None
        for chunk in chunks:
            for unit in chunk.sharding_units():
                mine = []
                for p in unit.parameters():
                    bucket = by_param[id(p)]
                    if bucket not in mine:
                        mine.append(bucket)
                    if bucket not in self.order:
                        self.order.append(bucket)
                unit.register_forward_pre_hook(self._make_hook(mine))
        if len(self.order) != len(buckets):
            raise ValueError("overlap_param_gather: a bucket holds parameters no unit uses")

    def _make_hook(self, buckets: List):
        def hook(module: nn.Module, args) -> None:
            self.wait(buckets)
        return hook

    def launch(self, issue: Optional[Callable[[object, Callable], object]] = None,
               later: Optional[Callable[[object], bool]] = None,
               ready: Optional[Callable[[object], bool]] = None) -> None:
        """Start every bucket's gather (after the optimizer step), first-used first; with
        `issue`, through `issue(bucket, gather)` (offload.optimizer: ordered after the bucket's
        host copy, `OptimizerOffload.gather_after_copy`). Buckets for which `later(bucket)`
        (their host step still runs) are deferred to their first use; `ready(bucket)`: whether
        a deferred bucket can go on the wire without a wait (launched one ahead of its use)."""
        self._launch_deferred(self.order)  # (a step with no forward since the last one)
        self._issue, self._ready = issue, ready
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
        """Launch the deferred gathers, in forward order, up to the last of `needed`, then
        further ones while their host step has finished."""
        wanted = {id(b) for b in needed}
        while self._deferred and (any(id(b) in wanted for b in self._deferred)
                                  or (self._ready is not None
                                      and self._ready(self._deferred[0]))):
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
