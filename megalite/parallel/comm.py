"""Instrumented collectives: every byte megalite sends goes through here and is counted.

Each call records, per (group, op): the number of calls, the payload bytes (the size of the
logical tensor being reduced / gathered / sent) and the ring *wire* bytes each rank sends for
it, using the standard ring costs (Patarasuk & Yuan 2009; as in NCCL's busbw):

    all_reduce        2 (N - 1) / N * S      (S = tensor bytes)
    reduce_scatter    (N - 1) / N * S        (S = full, unscattered input bytes)
    all_gather        (N - 1) / N * S        (S = full, gathered output bytes)
    broadcast         (N - 1) / N * S        (pipelined ring)
    send              S

A group of size 1 communicates nothing and records nothing. The counters live in the
`CommCounter` owned by the `Topology`; no module state.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0  # payload bytes
    wire_bytes: float = 0.0  # ring bytes sent by this rank


@dataclass
class CommCounter:
    """Byte counters keyed by (group name, op)."""

    stats: Dict[Tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def record(self, group: str, op: str, payload: int, wire: float) -> None:
        s = self.stats[(group, op)]
        s.calls += 1
        s.bytes += payload
        s.wire_bytes += wire

    def snapshot(self) -> Dict[str, Dict[str, float]]:
        """{"<group>/<op>": {"calls", "bytes", "wire_bytes"}} — cumulative since creation."""
        return {f"{g}/{op}": {"calls": s.calls, "bytes": s.bytes, "wire_bytes": s.wire_bytes}
                for (g, op), s in sorted(self.stats.items())}

    @staticmethod
    def delta(new: Dict[str, Dict[str, float]], old: Dict[str, Dict[str, float]]
              ) -> Dict[str, Dict[str, float]]:
        """Counts between two snapshots (e.g. over one logging interval)."""
        out = {}
        for key, cur in new.items():
            prev = old.get(key, {})
            out[key] = {k: v - prev.get(k, 0) for k, v in cur.items()}
        return out


@dataclass
class Group:
    """A process group this rank belongs to, with its name and the counter to report to."""

    name: str
    ranks: List[int]
    rank: int  # this process's index inside the group
    pg: Optional[dist.ProcessGroup]
    counter: CommCounter

    @property
    def size(self) -> int:
        return len(self.ranks)


def _ring(n: int) -> float:
    return (n - 1) / n


def all_reduce(tensor: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce."""
    if group.size > 1:
        nbytes = tensor.numel() * tensor.element_size()
        group.counter.record(group.name, "all_reduce", nbytes, 2 * _ring(group.size) * nbytes)
        dist.all_reduce(tensor, op=op, group=group.pg)
    return tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group,
                   op=dist.ReduceOp.SUM) -> torch.Tensor:
    """output (1/N of input, along dim 0) = this rank's chunk of the sum of inputs."""
    if group.size == 1:
        output.copy_(input)
        return output
    nbytes = input.numel() * input.element_size()
    group.counter.record(group.name, "reduce_scatter", nbytes, _ring(group.size) * nbytes)
    dist.reduce_scatter_tensor(output, input, op=op, group=group.pg)
    return output


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group) -> torch.Tensor:
    """output (N x input, along dim 0) = concatenation of every rank's input."""
    if group.size == 1:
        output.copy_(input)
        return output
    nbytes = output.numel() * output.element_size()
    group.counter.record(group.name, "all_gather", nbytes, _ring(group.size) * nbytes)
    dist.all_gather_into_tensor(output, input, group=group.pg)
    return output


def broadcast(tensor: torch.Tensor, group: Group, src_index: int = 0) -> torch.Tensor:
    """Broadcast from the group member with index `src_index` (not a global rank)."""
    if group.size > 1:
        nbytes = tensor.numel() * tensor.element_size()
        group.counter.record(group.name, "broadcast", nbytes, _ring(group.size) * nbytes)
        dist.broadcast(tensor, src=group.ranks[src_index], group=group.pg)
    return tensor


def all_reduce_scalars(values: List[float], group: Group, op=dist.ReduceOp.SUM,
                       device: Optional[torch.device] = None) -> List[float]:
    """All-reduce a few Python floats in one fp64 message (metrics, norms)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    all_reduce(t, group, op=op)
    return t.tolist()
