"""The run's position besides its tensors, as a checkpoint records it: the data position, the
skipped-step count, the fp16 loss scale and resilience.rerun's statistics (in meta.json, the
same on every rank), and this rank's random-number streams (`rng_rank<r>.pt`, restored when the
layout is unchanged). Each part comes from the `state_dict()` of the object that owns it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class Progress:
    """Where a run stands besides its tensors (the same on every rank, kept in meta.json)."""
    sampler: dict  # the data position: consumed samples (per-dataset counts of a blend)
    skipped_steps: int = 0  # non-finite steps skipped so far
    loss_scaler: Optional[dict] = None  # precision=fp16: the dynamic loss scale's state
    rerun: Optional[dict] = None  # resilience.rerun: the spike statistics and verdict counts


class ProcessRNG:
    """This process's random streams: the model's dropout streams (`RNGTracker`) and torch's
    CPU, NumPy's and Python's global generators."""

    def __init__(self, tracker):
        self.tracker = tracker

    def state_dict(self) -> dict:
        return {"tracker": self.tracker.state_dict(), "torch_cpu": torch.get_rng_state(),
                "numpy": np.random.get_state(), "python": random.getstate(),
                "device_type": self.tracker.device.type}

    def accepts(self, state: dict) -> bool:
        """Whether `state` was saved on this device type: a CUDA generator's state cannot seed
        a CPU one (nor the reverse). States written before the device type was recorded tell
        by the size of the replicated stream's state."""
        if "device_type" in state:
            return state["device_type"] == self.tracker.device.type
        return state["tracker"]["replicated"].numel() == \
            self.tracker.state_dict()["replicated"].numel()

    def load_state_dict(self, state: dict, device_streams: bool = True) -> None:
        """`device_streams=False`: all but the tracker's (a state from another device type:
        the host generators are the same kind everywhere)."""
        if device_streams:
            self.tracker.load_state_dict(state["tracker"])
        torch.set_rng_state(state["torch_cpu"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
