"""Norms over tensors laid out like the optimizer's master pieces, accumulated in fp64, and the
grouping by device that offloaded (host) pieces need."""
from __future__ import annotations

from typing import Dict, List

import torch


def squares_fp64(pieces: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of every element of `pieces`, accumulated in fp64 (each piece's norm
    computed in fp64 by `_foreach_norm(..., dtype=float64)`, then squared and summed in fp64):
    an fp32 accumulation is already off by ~1e-3 relative on one 38M-element piece."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in by_device(pieces).values():  # offloaded pieces: on the host
        norms = torch._foreach_norm(group, 2, dtype=torch.float64)
        total = total + torch.stack(norms).square().sum().to(device)
    return total


def by_device(tensors: List[torch.Tensor]) -> Dict[torch.device, List[torch.Tensor]]:
    groups: Dict[torch.device, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups
