"""The learning-rate schedule: linear warmup, then cosine decay to a floor.

The optimizer itself (AdamW with decay / no-decay groups over sharded master weights) and the
global-norm clipping live in `megalite.parallel.zero`, which owns the parameters.
"""
from __future__ import annotations

import math

from megalite.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup over `warmup_steps`
    from lr/warmup to lr, then cosine decay to `min_lr` at `decay_steps` (default max_steps),
    constant `min_lr` after (Loshchilov & Hutter 2017, SGDR without restarts)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = cfg.decay_steps or max_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
