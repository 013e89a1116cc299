"""ZeRO 1/2: the all-gather of the updated parameters overlapped with the next forward
(`parallel.overlap_param_gather`, Megatron's --overlap-param-gather).

After the optimizer step each DP rank holds the new values of its range only; every bucket's
all-gather brings the others' ranges. Done in the step, the next forward cannot start before
the last bucket arrived. Here the step only launches the gathers, asynchronously and in the
order the next forward uses the buckets, and every unit of the model (a chunk's
`sharding_units()`: embeddings, each block, ln_f, LM head) waits, in a forward pre-hook, for the
buckets holding its parameters. So the first block computes while the later buckets are still
on the wire (NCCL runs them on its own stream, gloo on its own threads).

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

    def launch(self, issue: Optional[Callable[[object, Callable], object]] = None) -> None:
        """Start every bucket's gather (after the optimizer step), first-used first; with
        `issue`, through `issue(bucket, gather)` (offload.optimizer: ordered after the bucket's
        host copy, `OptimizerOffload.gather_after_copy`)."""
        for bucket in self.order:
            def gather(b=bucket):
                return b.after_step(async_op=True)
            self._pending[id(bucket)] = gather() if issue is None else issue(bucket, gather)

    def wait(self, buckets=None) -> None:
        """Block until the gathers of `buckets` (default: all) are done."""
        for bucket in (self.order if buckets is None else buckets):
            work = self._pending.pop(id(bucket), None)
            if work is not None:
                work.wait()
