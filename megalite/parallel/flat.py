"""Flat buffers: a group of parameters laid end to end, padded so that N data-parallel ranks
own equal contiguous ranges (ZeRO's partitioning, Rajbhandari et al. 2019 §5).

    [ p0 ........ | p1 .... | p2 .............. | pad ]      numel padded to a multiple of N
    [   rank 0 range  |   rank 1 range  |   rank 2 range  ]

A rank's range cuts through parameters; `segments(lo, hi)` lists the pieces of each parameter
that fall inside it, which is what the sharded optimizer updates (AdamW is elementwise, so a
piece of a parameter is updated exactly as the whole would be).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn as nn

from megalite.parallel.param_spec import ParamSpec


@dataclass(frozen=True)
class Segment:
    name: str  # local parameter name
    spec: ParamSpec
    param_lo: int  # element range inside the flattened parameter
    param_hi: int
    flat_lo: int  # the same elements inside the flat buffer
    flat_hi: int

    @property
    def numel(self) -> int:
        return self.flat_hi - self.flat_lo


class FlatShards:
    """Offsets of `params` in a flat buffer of `padded_numel` elements split over `shards`."""

    def __init__(self, names: List[str], params: List[nn.Parameter], specs: List[ParamSpec],
                 shards: int, align: int = 1):
        self.names, self.params, self.specs = names, params, specs
        self.offsets: List[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        step = shards * align
        self.padded_numel = max(step, -(-total // step) * step)
        self.shards = shards
        self.shard_numel = self.padded_numel // shards

    def shard_range(self, index: int) -> Tuple[int, int]:
        return index * self.shard_numel, (index + 1) * self.shard_numel

    def segments(self, lo: int, hi: int) -> List[Segment]:
        out = []
        for name, p, spec, off in zip(self.names, self.params, self.specs, self.offsets):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                out.append(Segment(name, spec, a - off, b - off, a, b))
        return out

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's shape as a view into `flat` (a tensor of padded_numel elements)."""
        return [flat[off:off + p.numel()].view(p.shape) for p, off in zip(self.params, self.offsets)]
