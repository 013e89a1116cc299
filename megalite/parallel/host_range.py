"""One bucket's offloaded part in host memory (`megalite.parallel.offload`'s ranges): the
host master weights, gradient, staging and cast buffers of [cut, hi), and the tasks the offload
worker runs on them — a copy landed (`arrived`), zero 2/3's fold into the host gradient
(`fold`), the range's squares for the global norm once its gradient is final (`squares`,
`finalize`) — plus the host AdamW they are stepped by (`build_adamw`: fused where PyTorch has
the CPU kernel, `host_adamw_kind`).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from megalite.parallel.flat import Segment
from megalite.parallel.norms import squares_fp32_rows


@dataclass(frozen=True)
class AdamWSettings:
    """What the engine's AdamW takes of the optim section (`optim.lr`, `betas`, `eps`,
    `weight_decay`; the trainer sets each step's lr from the schedule). An `OptimConfig`,
    which has the same fields, is read alike."""

    lr: float
    betas: Tuple[float, float]
    eps: float
    weight_decay: float


def host_adamw_kind() -> str:
    """'fused' where this PyTorch has the fused CPU AdamW kernel (2.4+), else 'foreach'."""
    try:
        p = nn.Parameter(torch.zeros(1))
        torch.optim.AdamW([p], fused=True)
        return "fused"
    except (RuntimeError, TypeError):
        return "foreach"


def build_adamw(pieces: List[nn.Parameter], decays: List[bool], cfg: AdamWSettings, kind: str
                ) -> torch.optim.AdamW:
    """AdamW over `pieces` (decay / no-decay groups by `decays`), `kind` fused or foreach."""
    groups = [g for g in ({"params": [p for p, d in zip(pieces, decays) if d],
                           "weight_decay": cfg.weight_decay},
                          {"params": [p for p, d in zip(pieces, decays) if not d],
                           "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             **{kind: True})


def host_parts(bucket, cut: int) -> List[Tuple[int, torch.dtype]]:
    """(numel, dtype) of the host buffers of `bucket`'s range [cut, hi), in `HostRange`'s
    order: the fp32 master weights, the fp32 gradient, zero 2/3's fp32 copy staging, and the
    cast to the model dtype where it is not fp32 (the AdamW moments are AdamW's own)."""
    numel = bucket.hi - cut
    parts = [(numel, torch.float32)] * (3 if bucket.reduction.every_micro_batch else 2)
    dtype = bucket.param_region.dtype
    return parts + ([] if dtype == torch.float32 else [(numel, dtype)])


class HostRange:
    """The offloaded part [cut, hi) of one bucket's owned range [lo, hi) in host memory:
    `buffers`, zeroed tensors of `host_parts(bucket, cut)` (slices of the rank's arena)."""

    def __init__(self, bucket, cut: int, buffers: List[torch.Tensor]):
        self.bucket, self.cut, self.offset = bucket, cut, cut - bucket.lo
        self.accumulate = bucket.reduction.every_micro_batch  # zero 2/3: a sum of copies
        self.main, self.grad = buffers[0], buffers[1]  # fp32 master weights, gradient
        self.main.copy_(bucket.main[self.offset:])
        # zero 0/1: the step's one copy lands in the gradient itself
        self.staging = buffers[2] if self.accumulate else self.grad
        self.cast = buffers[-1] if bucket.param_region.dtype != torch.float32 else None
        self.pieces: List[nn.Parameter] = []
        self.decays: List[bool] = []
        self.optimizer: Optional[torch.optim.AdamW] = None
        self.fused = False  # the host AdamW is the fused kernel (it takes `grad_scale`)
        self.norm_pieces: List[torch.Tensor] = []  # counted gradient pieces no sum changes
        # worker-side state (the worker runs a range's tasks in the order they were queued)
        self.inbound: Optional[Future] = None  # the last gradient task (copy landed, fold)
        self.stepped: Optional[Future] = None  # the last host step (update, cast, copy out)
        self.in_flight: List[tuple] = []  # (reduction, its source) not yet completed
        self.deferred = 0  # CPU: of those, reductions whose result is still to be copied
        self.fresh = True  # zero 2/3: the next fold is the step's first (a copy, not a sum)
        self.squares: Optional[torch.Tensor] = None  # of `norm_pieces`, once final (fp64)
        self.copied_out = None  # CUDA: the event of the last copy of the parameters out

    def piece(self, seg: Segment) -> nn.Parameter:
        """The master piece of `seg` (inside [cut, hi)), its gradient in the host gradient."""
        a, b = seg.flat_lo - self.cut, seg.flat_hi - self.cut
        piece = nn.Parameter(self.main[a:b])
        piece.grad = self.grad[a:b]
        self.pieces.append(piece)
        self.decays.append(seg.spec.weight_decay)
        return piece


def fold(r: HostRange) -> None:
    """Zero 2/3: add the copy that landed in `r.staging` into the host gradient (the step's
    first copies it: the device's 0 + x, without zeroing the gradient first)."""
    if r.fresh:
        r.grad.copy_(r.staging)
        r.fresh = False
    else:
        r.grad.add_(r.staging)


def squares(r: HostRange) -> None:
    """`r`'s share of the global norm: the squares of its counted pieces (final gradient)."""
    r.squares = squares_fp32_rows(r.norm_pieces, torch.device("cpu")) if r.norm_pieces \
        else None


def arrived(r: HostRange, copied, final: bool) -> None:
    """The worker's task after a gradient copy was issued: wait for it to land (`copied`:
    its CUDA event), fold it (zero 2/3) and, when the range's gradient is `final` (zero
    0/1: the step's one copy), square it."""
    if copied is not None:
        copied.synchronize()
    if r.accumulate:
        fold(r)
    if final:
        squares(r)


def finalize(r: HostRange) -> None:
    """Zero 2/3 at the end of the backward: a range no gradient reached this step is zeros
    (as the device's part); then its squares."""
    if r.fresh:
        r.grad.zero_()
        r.fresh = False
    squares(r)


def mark_fresh(r: HostRange) -> None:
    r.fresh = True
