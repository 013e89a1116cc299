"""Loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training", §3.2).

fp16 has 5 exponent bits: gradients below 2^-24 flush to zero. Multiplying the loss by S before
backward multiplies every gradient by S (the chain rule is linear), lifting small gradients
into fp16's range; the fp32 master gradients are divided by S again before clipping and the
optimizer step, so the update is the one of the unscaled loss. Too large an S overflows some
gradient to inf/NaN instead; then the step is skipped.

Static scaling keeps S fixed. Dynamic scaling (Megatron's DynamicGradScaler, PyTorch's
GradScaler) adapts it:

    overflow:  the step is skipped; after `hysteresis` overflows since the last growth,
               S <- max(S * 0.5, min_scale)
    no overflow for `window` consecutive steps:  S <- 2 * S (and the hysteresis is reset)

Scales stay powers of two times the initial scale, so scaling and unscaling are exact in
floating point. The overflow test is the global gradient norm being non-finite, which every
rank computes alike, so every rank skips the same steps and holds the same S.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megalite.config.sections import LossScaleConfig

BACKOFF = 0.5
GROWTH = 2.0


@dataclass
class LossScaler:
    """The current scale and the counters that move it (see the module docstring)."""

    scale: float
    dynamic: bool = True
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    good_steps: int = 0  # finite steps since the last overflow or growth
    hysteresis_left: int = 2  # overflows still tolerated before the next backoff

    @classmethod
    def from_config(cls, cfg: LossScaleConfig) -> "LossScaler":
        if cfg.static is not None:
            return cls(scale=float(cfg.static), dynamic=False)
        return cls(scale=float(cfg.initial), min_scale=float(cfg.min), window=cfg.window,
                   hysteresis=cfg.hysteresis, hysteresis_left=cfg.hysteresis)

    def update(self, overflow: bool) -> bool:
        """Account for one step; returns whether its overflow (if any) is the scale's to
        absorb: a dynamic scale above its floor will shrink. An overflow at a static scale or at
        the floor means the run itself is producing non-finite values."""
        if not self.dynamic:
            return False
        if not overflow:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= GROWTH
                self.good_steps = 0
                self.hysteresis_left = self.hysteresis
            return False
        absorbed = self.scale > self.min_scale
        self.good_steps = 0
        self.hysteresis_left -= 1
        if self.hysteresis_left <= 0:
            self.scale = max(self.scale * BACKOFF, self.min_scale)
        return absorbed

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Continue a checkpointed dynamic scale (a static scale is the config's)."""
        if not self.dynamic or not state:
            return
        if not (math.isfinite(state["scale"]) and state["scale"] > 0):
            raise ValueError(f"loss scale {state['scale']!r} in the checkpoint is not a "
                             "positive finite number")
        self.scale = max(float(state["scale"]), self.min_scale)
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
