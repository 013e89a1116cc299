"""Where a training step's time goes, by phase (Megatron's timers at --timing-log-level 1):

    data              reading this step's micro-batches and copying them to the device
    forward_backward  the pipeline schedule: every micro-batch's forward and backward, with the
                      pipeline's transfers and waits, ZeRO-3's gathers, and the gradient
                      reductions that overlap the backward
    grad_sync         waiting for the gradient reductions still in flight after the last
                      backward, and the TP / embedding-group sums (the exposed DP communication)
    optimizer         global gradient norm, clipping, AdamW, the parameter update (and zero 1/2's
                      all-gather unless it overlaps the next forward)
    offload_wait      offload.optimizer: blocked on the copies of gradients to the host and of
                      parameters back (part of grad_sync and optimizer, counted in both)

Marks are taken on the device's timeline (`megalite.utils.clock`), so timing costs the GPU nothing;
they are resolved when the metrics line is written. The trainer reports each phase's seconds
per step of the slowest rank (MAX over the world): on a dashboard the phase that grows is the
one that holds every rank back.

With `waits` (`megalite.parallel.group.CollectiveWaits`, on while straggler reports are on) the
timers also keep each phase's *compute* time: the phase's time less the time this rank spent
inside collectives during it (waiting for peers or the network). A slow rank makes its peers
wait in their collectives, so their phases grow but their compute does not; `take_compute`
gives it to the straggler report (`megalite.resilience.stragglers`).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from megalite.parallel.group import CollectiveWaits
from megalite.utils.clock import DeviceClock

PHASES = ("data", "forward_backward", "grad_sync", "optimizer", "offload_wait")
NESTED = ("offload_wait",)  # inside other phases: not part of a sum of phases


class StepTimers:
    def __init__(self, device: torch.device, waits: Optional[CollectiveWaits] = None):
        self.clock = DeviceClock(device)
        self.waits = waits
        # (phase, start, end, the waits' positions at its start and end)
        self._marks: List[Tuple[str, object, object, object, object]] = []
        self._spent = dict.fromkeys(PHASES, 0.0)
        self._compute = dict.fromkeys(PHASES, 0.0)

    def _waits_so_far(self):
        return None if self.waits is None else self.waits.position()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown step phase {name!r}; one of {PHASES}")
        start, first_wait = self.clock.mark(), self._waits_so_far()
        yield
        self._marks.append((name, start, self.clock.mark(), first_wait, self._waits_so_far()))

    def _resolve(self) -> None:
        """Fold the marks into seconds (on CUDA: waits for them). Collectives outside the
        phases (evaluation, metrics, checkpoints) are dropped with the rest of the marks."""
        for name, start, end, first, last in self._marks:
            seconds = self.clock.seconds(start, end)
            waited = 0.0 if first is None or last is None or self.waits is None \
                else self.waits.between(first, last)
            self._spent[name] += seconds
            self._compute[name] += max(0.0, seconds - waited)
        self._marks = []
        if self.waits is not None:
            self.waits.clear()

    def take(self) -> Dict[str, float]:
        """Seconds spent in each phase since the last call."""
        self._resolve()
        spent, self._spent = self._spent, dict.fromkeys(PHASES, 0.0)
        return spent

    def take_compute(self) -> Dict[str, float]:
        """Seconds each phase computed (its time less the time inside collectives; all of
        its time without `waits`) since the last call; the phases that do not nest, so
        that they add up to the step (the straggler report sums them)."""
        self._resolve()
        compute, self._compute = self._compute, dict.fromkeys(PHASES, 0.0)
        return {k: v for k, v in compute.items() if k not in NESTED}

    def reset(self) -> None:
        """Forget everything measured so far (steps run outside the training loop)."""
        self.take()
        self.take_compute()
