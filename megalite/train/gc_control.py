"""Python's garbage collector at fixed steps on every rank (Megatron's --manual-gc
--manual-gc-interval, torchtitan's training.gc_freq).

Left automatic, the collector runs when a rank's allocation counters say so: at a different
moment on every rank, and a rank that pauses inside a step holds up every collective the
other ranks wait for it in, a straggler that grows with the number of ranks. With
`train.gc_every=N` automatic collection is off while training runs and every rank collects
after the same steps (every N-th); the previous setting is restored when training ends.
"""
from __future__ import annotations

import gc
from typing import Optional


class ScheduledGC:
    def __init__(self, every: Optional[int]):
        self.every = every
        self._was_enabled = True  # the setting to restore, read on entering

    def __enter__(self) -> "ScheduledGC":
        if self.every is not None:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()  # start from a clean heap: what start-up left behind
        return self

    def __exit__(self, *exc) -> None:
        if self.every is not None and self._was_enabled:
            gc.enable()

    def after_step(self, step: int) -> None:
        if self.every is not None and step % self.every == 0:
            gc.collect()
