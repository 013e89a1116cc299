"""Norms over tensors laid out like the optimizer's master pieces (`global_norm`: the whole
model's, each element counted once), and the grouping by device that offloaded (host) pieces
need.

Accuracy: an fp32 accumulation over one 38M-element piece (gpt2's embedding) is off by ~1e-3
relative on CPU (the reduction adds nearly in sequence). The device's pieces therefore
accumulate in fp64 from the elements up (`squares_fp64`). The host's (offloaded) pieces sit on
the CPU, where that fp64 norm costs ~20x an fp32 one (measured on 38.6M elements, one thread:
288 ms against 13 ms), so `squares_fp32_rows` cuts them into rows of ROW elements, takes each
row's norm in fp32 (a few hundred additions each: ~1e-7 relative) and sums the rows' squares
in fp64 — 1.2e-8 relative on the same piece, far inside what the tests compare at (1e-5)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megalite.parallel import comm
from megalite.parallel.topology import Topology

ROW = 1024  # elements per fp32 partial norm of a host piece


def squares_fp64(pieces: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of every element of `pieces`, accumulated in fp64 (each piece's norm
    computed in fp64 by `_foreach_norm(..., dtype=float64)`, then squared and summed in fp64)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in by_device(pieces).values():
        norms = torch._foreach_norm(group, 2, dtype=torch.float64)
        total = total + torch.stack(norms).square().sum().to(device)
    return total


def squares_fp32_rows(pieces: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of every element of the (host) `pieces`: fp32 norms of rows of ROW
    elements (and of each piece's shorter tail), their squares summed in fp64. Returns an
    fp64 scalar on `device`."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in by_device(pieces).values():
        squares, tails = [], []
        for t in group:
            t = t.reshape(-1)
            rows = t.numel() // ROW
            if rows:
                norms = torch.linalg.vector_norm(t[:rows * ROW].view(rows, ROW), dim=1)
                squares.append(norms.double().square().sum())
            if t.numel() > rows * ROW:
                tails.append(t[rows * ROW:])
        if tails:
            squares.append(torch.stack(torch._foreach_norm(tails, 2)).double().square().sum())
        if squares:
            total = total + torch.stack(squares).sum().to(device)
    return total


def by_device(tensors: List[torch.Tensor]) -> Dict[torch.device, List[torch.Tensor]]:
    groups: Dict[torch.device, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def global_norm(pieces: Tuple[List[torch.Tensor], ...], topo: Topology, shards_optimizer: bool,
                device: torch.device, host_squares: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """L2 norm over the whole model of (device, host, expert device, expert host) tensors laid
    out like the ZeRO engine's master pieces, each element counted once (`megalite.parallel
    .zero`'s docstring; `shards_optimizer`: each DP x CP rank holds its own range). The
    device's pieces accumulate in fp64 from the elements up (DeepSpeed's fp64 norm), so the
    result does not move with how a layout cuts the model into pieces; offloaded pieces, on
    the host CPU where fp64 is ~20x slower, in fp32 over rows of 1024 elements with the rows'
    squares summed in fp64 (`squares_fp32_rows`: ~1e-8 relative; `host_squares`: those of
    further host pieces, taken already); the DP / model-parallel all-reduces in fp64. Returns
    an fp64 scalar on `device`."""
    device_pieces, host_pieces, expert_pieces, expert_host = pieces
    sq = squares_fp64(device_pieces, device) + squares_fp32_rows(host_pieces, device)
    if host_squares is not None:
        sq = sq + host_squares.to(device)
    if shards_optimizer:
        comm.all_reduce(sq, topo.grad_group)
    if topo.ep_size > 1:  # each expert shard once: its EDP ranges, every EP rank's
        experts = squares_fp64(expert_pieces, device) \
            + squares_fp32_rows(expert_host, device)
        if shards_optimizer:
            comm.all_reduce(experts, topo.expert_grad_group)
        comm.all_reduce(experts, topo.ep_group)  # the stage's experts, each once
        if topo.coords.tp_rank == 0:  # every TP rank holds that sum (EP folds over
            sq = sq + experts         # TP): the mp_group's sum counts it once
    comm.all_reduce(sq, topo.mp_group)
    return sq.sqrt()
