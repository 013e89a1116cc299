"""The routed experts: E SwiGLU MLPs with stacked weights — `gate_up_proj` [E, 2I, h] ([gate |
up] of each expert, transformers 5's fused layout) and `down_proj` [E, h, I] — and the dispatch
that sends each (token, choice) assignment to its expert and combines the weighted outputs.

Dispatch: the T·k assignments are ordered expert-major (`Dispatch`); each expert computes its
rows, y_e = down_e(silu(gate_e(x)) · up_e(x)), and the token's output is the sum over its
experts, in expert order, of y_e · weight (transformers' loop accumulates in the same order).
Dropless by default. With a capacity C = ceil(capacity_factor · k·T / E) an expert keeps at
most C assignments — those of the highest routing weight (drop_policy=probs) or of the
earliest tokens (position) — and the others contribute nothing (counted as dropped; the token
keeps its other experts and the residual).

The experts' products run as one `torch._grouped_mm` over the expert-major rows where it
takes them (experts_impl=auto: 16-byte aligned sizes on a CPU, or on CUDA in bf16 — its
CUDA kernel's dtype; grouped: wherever PyTorch has it) or expert by expert (loop); the same
numbers either way (`megalite-bench moe`: on a CPU grouped is 1.2x the loop's layer speed). An expert with no
assignment computes nothing and its weights' gradient is zero. With `fp8` set (fp8.recipe=
tensorwise, `megalite.parallel.fp8.use_fp8`) both products run in FP8, expert by expert, each
expert's weight and rows scaled alone (`megalite.model.moe.fp8_experts`), the amaxes reduced
over the TP and CP groups of the layer's `TokenSplit` where the serial run's span more; under
EP each source's rows with its micro-batch's amaxes (`megalite.model.moe.fp8_sources`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.config.moe import MoEConfig
from megalite.model.moe.fp8_experts import PerExpert, fp8_expert_products
from megalite.model.moe.fp8_sources import PerSource, Sources
from megalite.model.moe.tokens import NO_SPLIT, TokenSplit
from megalite.parallel.fp8 import Fp8Linear
from megalite.parallel.group import single_rank_group


@dataclass
class Dispatch:
    """Which assignments each expert computes: `order` [N] the kept assignments' flat indices
    (t·k + j) expert-major, `counts` [E] the kept assignments per expert, `routed` [E] those
    the router chose (before the capacity), `dropped` the assignments over capacity."""

    order: torch.Tensor
    counts: torch.Tensor
    routed: torch.Tensor
    dropped: torch.Tensor


def capacity(moe: MoEConfig, tokens: int) -> Optional[int]:
    """The most assignments an expert takes from `tokens` tokens (None: dropless)."""
    if moe.capacity_factor is None:
        return None
    return math.ceil(moe.capacity_factor * moe.top_k * tokens / moe.num_experts)


def dispatch(indices: torch.Tensor, weights: torch.Tensor, experts: int,
             cap: Optional[int], policy: str = "probs") -> Dispatch:
    """The expert-major order of the assignments `indices` [T, k] (module docstring)."""
    flat = indices.reshape(-1)
    # not bincount: on CUDA it reads min and max on the host to size its output (two syncs a
    # layer and micro-batch)
    routed = torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    if cap is not None and policy == "probs":  # within an expert: by weight, highest first
        pre = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
    else:  # by position (token, then choice)
        pre = torch.arange(flat.numel(), device=flat.device)
    order = pre[torch.argsort(flat[pre], stable=True)]
    if cap is None:
        return Dispatch(order, routed, routed, torch.zeros((), dtype=torch.long,
                                                            device=flat.device))
    starts = torch.cumsum(routed, 0) - routed
    rank = torch.arange(order.numel(), device=flat.device) - starts[flat[order]]
    kept = rank < cap
    return Dispatch(order[kept], routed.clamp(max=cap), routed, (~kept).sum())


def assignment_tokens(order: torch.Tensor, k: int) -> torch.Tensor:
    """The token of each assignment t·k + j in `order`."""
    return torch.div(order, k, rounding_mode="floor")


def combine(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
            tokens: torch.Tensor) -> torch.Tensor:
    """[T, h]: each token's sum, in `order` (expert-major), of its experts' outputs `y` [N, h]
    (one row per assignment of `order`) weighted by the router's `weights` [T, k]."""
    y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)


class Experts(nn.Module):
    """E SwiGLU experts of hidden size I on h-wide tokens (module docstring); `split` the
    groups the layer's tokens and experts are split over (`megalite.model.moe.tokens`)."""

    def __init__(self, moe: MoEConfig, hidden: int, expert_hidden: int,
                 split: TokenSplit = NO_SPLIT, ep: int = 1):
        """`ep`: the experts are split over ep ranks (expert parallelism); this module holds
        num_experts / ep of them (`megalite.model.moe.dispatcher` brings their rows)."""
        super().__init__()
        e = moe.num_experts // ep
        self.moe, self.split = moe, split
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * expert_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, expert_hidden))
        self.fp8: Optional[str] = None  # tensorwise: the products in FP8 (module docstring)

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether the products run as `torch._grouped_mm` (experts_impl)."""
        impl = self.moe.experts_impl
        if impl == "loop" or not hasattr(torch, "_grouped_mm"):
            return False
        aligned = all(n * x.element_size() % 16 == 0 for n in self.down_proj.shape[1:])
        if impl == "grouped":
            return aligned
        return aligned and (x.device.type == "cpu" or (x.is_cuda and x.dtype == torch.bfloat16))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, d: Dispatch) -> torch.Tensor:
        """x [T, h], the routing weights [T, k] and the dispatch -> the combined [T, h]."""
        tokens = assignment_tokens(d.order, weights.shape[1])
        return combine(x, self.compute(x[tokens], d.counts), weights, d.order, tokens)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor,
                sources: Optional[Sources] = None) -> torch.Tensor:
        """The experts' outputs of expert-major `rows` [N, h], `counts` [E local] of them
        each (under EP `sources`: where they came from, which FP8 scales by). No rows at all
        (an EP rank that received no token) still runs an expert on the empty rows, so that
        the weights' gradient is zero rather than absent (the reduction of every rank's
        gradient waits for it), and FP8 still takes part in its amax reductions."""
        if self.fp8 is not None:
            return self._fp8(rows, counts, sources)
        if rows.shape[0] == 0:
            return self._expert(rows, 0)
        return self._grouped(rows, counts) if self.grouped(rows) else self._loop(rows, counts)

    def _expert(self, rows: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def _loop(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = [self._expert(part, e) for e, part in enumerate(rows.split(counts.tolist()))
                if part.shape[0]]
        return torch.cat(outs)

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)

    def _fp8(self, rows: torch.Tensor, counts: torch.Tensor,
             sources: Optional[Sources]) -> torch.Tensor:
        if sources is None:  # the experts split over TP like the dense MLP, tokens over CP
            scaling = PerExpert(counts.tolist())
            tp = self.split.tp if self.split.tp is not None else single_rank_group("experts")
            cp = self.split.cp
        else:  # EP: whole experts, each segment scaled by its source's micro-batch
            scaling = PerSource(sources, [self.split.tp, self.split.cp])
            tp, cp = single_rank_group("experts"), None
        gate_up, down = (Fp8Linear(self.fp8, tp, column, token_group=cp)
                         for column in (True, False))
        gate, up = fp8_expert_products(rows, self.gate_up_proj, scaling, gate_up).chunk(2, -1)
        return fp8_expert_products(F.silu(gate) * up, self.down_proj, scaling, down)
