"""The global batch size of each step: constant, or ramped up from a small batch (Megatron's
--rampup-batch-size START INCREMENT SAMPLES; GPT-3, Brown et al. 2020 §2.3 and App. B: "we
gradually increase the batch size linearly from a small value").

With a ramp, a run that has consumed c samples takes

    B(c) = START + INCREMENT · floor(c / (SAMPLES / k))   for c <= SAMPLES,   else  B,

k = (B − START) / INCREMENT increments, B = train.global_batch_size. The batch size is a
function of the data position alone, which the checkpoint holds, so a resumed run (in any
layout) continues the same ramp. Each step runs B(c) / (micro_batch_size · dp) micro-batches;
the learning-rate schedule stays one of optimizer steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class BatchSizeSchedule:
    final: int  # train.global_batch_size
    rampup: Optional[Sequence[int]] = None  # [start, increment, samples]

    def at(self, consumed_samples: int) -> int:
        """The global batch size of the step that starts after `consumed_samples`."""
        if self.rampup is None:
            return self.final
        start, increment, samples = self.rampup
        if consumed_samples > samples:
            return self.final
        per_increment = samples / ((self.final - start) // increment)
        return min(self.final, start + increment * int(consumed_samples / per_increment))
