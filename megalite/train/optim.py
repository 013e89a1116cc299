"""The learning-rate schedule: linear warmup, then a decay to a floor of one of four shapes.

The optimizer itself (AdamW with decay / no-decay groups over sharded master weights) and the
global-norm clipping live in `megalite.parallel.zero`, which owns the parameters.
"""
from __future__ import annotations

import math

from megalite.config.schema import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Warmup: linear over `warmup_steps` from lr/warmup to lr. Then, until `decay_steps`
    (default max_steps), by `cfg.schedule`:

        cosine    min_lr + (lr − min_lr)·(1 + cos(π·p))/2, p the progress from warmup to
                  decay_steps (Loshchilov & Hutter 2017, SGDR without restarts)
        linear    lr − (lr − min_lr)·p
        constant  lr (min_lr unused)
        wsd       warmup-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024): lr until
                  the last `wsd_decay_fraction` of the post-warmup steps, then linear to min_lr

    After decay_steps: min_lr (constant: lr).
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = cfg.decay_steps or max_steps
    if step >= decay_steps:
        return cfg.min_lr
    start = cfg.warmup_steps
    if cfg.schedule == "wsd":
        start = decay_steps - max(1, round(cfg.wsd_decay_fraction * (decay_steps - start)))
        if step < start:
            return cfg.lr
    progress = (step - start) / max(1, decay_steps - start)
    if cfg.schedule == "cosine":
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
    return cfg.lr - progress * (cfg.lr - cfg.min_lr)
