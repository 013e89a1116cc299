"""What makes a step suspicious (`resilience.rerun`): a non-finite loss or gradient norm, and
with `on_spike` a value far above its recent history.

A spike is a value above `factor` times the running median of the last `window` values of
the steps that were applied (suspicious steps judged to be data are not recorded, so a bad
batch does not raise the median for the next). The median, not the mean, so one earlier spike
does not hide the next; nothing is judged before `warmup` values are recorded (the first
steps' loss falls fast and their norms are large). The loss and the gradient norm each have
their own history. The statistics are the run's global values (the same on every rank), so
every rank judges alike; they are saved in checkpoints (`state_dict()`), so a resumed run
detects spikes as the uninterrupted run would have.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Deque, Dict, List, Optional

TRACKED = ("loss", "grad_norm")


class RunningMedian:
    """The median of the last `window` values recorded."""

    def __init__(self, window: int):
        self.values: Deque[float] = deque(maxlen=window)

    def record(self, value: float) -> None:
        self.values.append(float(value))

    def median(self) -> Optional[float]:
        return statistics.median(self.values) if self.values else None


class SpikeDetector:
    """The suspicion test of a step (see the module docstring). `spikes=False` (rerun=on_nan):
    only non-finite values are suspicious."""

    def __init__(self, spikes: bool, factor: float, window: int, warmup: Optional[int]):
        self.spikes, self.factor, self.warmup = spikes, factor, warmup or 0
        self.history: Dict[str, RunningMedian] = {k: RunningMedian(window) for k in TRACKED}
        self.recorded = 0  # applied steps recorded so far (the warm-up counts them)

    def suspicious(self, values: Dict[str, float]) -> List[str]:
        """Why the step with these values (loss, grad_norm; a missing one is not judged) is
        suspicious: one reason per value, empty when it is not."""
        reasons = []
        for name, value in values.items():
            if not math.isfinite(value):
                reasons.append(f"{name} {value}")
                continue
            median = self.history[name].median()
            if (self.spikes and self.recorded >= self.warmup and median is not None
                    and median > 0 and value > self.factor * median):
                reasons.append(f"{name} {value:.6g} > {self.factor:g} x its running median "
                               f"{median:.6g}")
        return reasons

    def record(self, values: Dict[str, float]) -> None:
        """Add an applied step's values to the history."""
        for name, value in values.items():
            if math.isfinite(value):
                self.history[name].record(value)
        self.recorded += 1

    def state_dict(self) -> dict:
        return {"recorded": self.recorded,
                "history": {k: list(h.values) for k, h in self.history.items()}}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Continue a checkpointed history (a checkpoint without one starts afresh)."""
        if not state:
            return
        self.recorded = int(state["recorded"])
        for name, values in state["history"].items():
            history = self.history[name]
            history.values.clear()
            history.values.extend(float(v) for v in values)
