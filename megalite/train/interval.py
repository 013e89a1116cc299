"""The steps between two metrics lines: what they add up to (`Interval`), and the figures over
ranks a line reports for them (the slowest rank's time in each phase, the pipeline's measured
bubble). Collective where it says so; the Trainer owns the interval and writes the line."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.topology import Topology
from megalite.train.timers import PHASES, StepTimers


@dataclass
class Interval:
    """What the steps since the last metrics line add up to."""
    t0: float = field(default_factory=time.perf_counter)
    steps: int = 0
    samples: int = 0  # sequences trained on (the global batch sizes of the steps)
    losses: List[float] = field(default_factory=list)  # of the steps not skipped
    comm: dict = field(default_factory=dict)  # bytes sent by the training steps
    excluded_s: float = 0.0  # evaluation, profiler export: not training time
    checkpoint_s: float = 0.0  # waiting for checkpoint saves
    visible_pairs: int = 0  # attention (query, key) pairs under the document mask, this rank's

    def add_step(self, loss: Optional[float], step_comm: dict, batch_size: int,
                 visible_pairs: int = 0) -> None:
        self.steps += 1
        self.samples += batch_size
        self.visible_pairs += visible_pairs
        if loss is not None:
            self.losses.append(loss)
        for key, counts in step_comm.items():
            acc = self.comm.setdefault(key, {})
            for name, value in counts.items():
                acc[name] = acc.get(name, 0) + value

    def training_seconds(self) -> float:
        """Wall time since the interval began, less evaluation, profiler exports and
        checkpoint waits."""
        return time.perf_counter() - self.t0 - self.excluded_s - self.checkpoint_s


def slowest_phases(timers: StepTimers, topo: Topology, device: torch.device,
                   steps: int) -> dict:
    """Seconds per step in each phase of the step (`megalite.train.timers`), of the rank
    slowest in that phase (collective)."""
    spent = timers.take()
    values = [spent[p] / steps for p in PHASES]
    for group in (topo.mp_group, topo.grad_group):  # together: the whole world
        values = comm.all_reduce_scalars(values, group, device, op=dist.ReduceOp.MAX)
    return dict(zip(PHASES, values))


def measured_bubble(trace, topo: Topology, device: torch.device) -> float:
    """Idle fraction of a log step's pipeline (its `trace`), averaged over the stages
    (collective over PP). The stages start the step together (the previous step ended with a
    global reduction), so each stage's idle time counts against the step's common length,
    the longest stage's: a stage that finishes its last backward early waits for the earlier
    stages' backwards."""
    group = topo.pp_group
    wall = comm.all_reduce_scalars([trace.wall], group, op=dist.ReduceOp.MAX, device=device)[0]
    idle = 1.0 - trace.busy / wall if wall > 0 else 0.0
    return comm.all_reduce_scalars([idle], group, device=device)[0] / topo.pp_size
