"""Stopping a run early, cleanly: a checkpoint, then a normal exit (Megatron's
--exit-duration-in-mins and --exit-signal-handler).

`train.max_minutes`: stop once the run has trained this long (set it below the scheduler's
time limit, with room for one checkpoint). `train.exit_signal` (e.g. SIGTERM, what Slurm and
torchrun send before killing, or SIGUSR1 with `sbatch --signal=USR1@300`): the signal only sets
a flag, the current step finishes.

A signal can reach the ranks at different steps and clocks differ, so after every step the
ranks agree (one all-reduce of a flag, MAX over the world, only when either option is set):
every rank stops after the same step, saves the same checkpoint and returns from `fit`, and
`checkpoint.resume=auto` continues from there.
"""
from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.topology import Topology


class StopRequest:
    def __init__(self, max_minutes: Optional[float], exit_signal: Optional[str],
                 topo: Topology, device: torch.device):
        self.max_s = max_minutes * 60 if max_minutes is not None else None
        self.signal = getattr(signal, exit_signal) if exit_signal else None
        self.topo, self.device = topo, device
        self.start = time.monotonic()
        self.received: Optional[str] = None  # the signal's name once it arrived
        self._previous = None

    @property
    def enabled(self) -> bool:
        return self.max_s is not None or self.signal is not None

    def __enter__(self) -> "StopRequest":
        self.start = time.monotonic()
        if self.signal is not None:
            self._previous = signal.signal(self.signal, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self.signal is not None:
            signal.signal(self.signal, self._previous)

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def reason(self) -> Optional[str]:
        """Collective when enabled: why every rank stops now, or None to go on."""
        if not self.enabled:
            return None
        codes = [self.received is not None,
                 self.max_s is not None and time.monotonic() - self.start >= self.max_s]
        flags = torch.tensor([float(c) for c in codes], device=self.device)
        for group in (self.topo.mp_group, self.topo.grad_group):  # together: the whole world
            comm.all_reduce(flags, group, op=dist.ReduceOp.MAX)
        if flags[0].item():
            return f"{signal.Signals(self.signal).name} received"
        if flags[1].item():
            return f"train.max_minutes={self.max_s / 60:g} reached"
        return None
