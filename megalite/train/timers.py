"""Where a training step's time goes, by phase (Megatron's timers at --timing-log-level 1):

    data              reading this step's micro-batches and copying them to the device
    forward_backward  the pipeline schedule: every micro-batch's forward and backward, with the
                      pipeline's transfers and waits, ZeRO-3's gathers, and the gradient
                      reductions that overlap the backward
    grad_sync         waiting for the gradient reductions still in flight after the last
                      backward, and the TP / embedding-group sums (the exposed DP communication)
    optimizer         global gradient norm, clipping, AdamW, the parameter update (and zero 1/2's
                      all-gather unless it overlaps the next forward)

Marks are taken on the device's timeline (`megalite.clock`), so timing costs the GPU nothing;
they are resolved when the metrics line is written. The trainer reports each phase's seconds
per step of the slowest rank (MAX over the world): on a dashboard the phase that grows is the
one that holds every rank back.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Tuple

import torch

from megalite.clock import DeviceClock

PHASES = ("data", "forward_backward", "grad_sync", "optimizer")


class StepTimers:
    def __init__(self, device: torch.device):
        self.clock = DeviceClock(device)
        self._marks: List[Tuple[str, object, object]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown step phase {name!r}; one of {PHASES}")
        start = self.clock.mark()
        yield
        self._marks.append((name, start, self.clock.mark()))

    def take(self) -> Dict[str, float]:
        """Seconds spent in each phase since the last call (on CUDA: waits for the marks)."""
        spent = dict.fromkeys(PHASES, 0.0)
        for name, start, end in self._marks:
            spent[name] += self.clock.seconds(start, end)
        self._marks = []
        return spent
