"""The routed experts' products in FP8, tensorwise per expert (`fp8.recipe=tensorwise` with MoE;
the dense recipe is `megalite.parallel.fp8`'s).

One call computes y_e = x_e · W_eᵀ for every expert e of a stacked weight W [E, M, K], on the
expert-major rows x [N, K] (`megalite.model.moe.experts.Dispatch`: expert e's rows are the e-th
of `counts`). Each expert's three products run as `torch._scaled_mm` on float8 operands with
fp32 accumulation, scaled as the dense tensorwise recipe scales a linear (current scaling: an
operand's amax lands on the format's largest finite value; Micikevicius et al. 2022), with one
scale per expert's tensor rather than one over the stack:

    forward   x_e [n_e, K] (e4m3, x_e's amax)  · W_e [M, K] (e4m3, W_e's amax)
    dx_e      dy_e [n_e, M] (e5m2, dy_e's amax) · W_eᵀ
    dW_e      dy_eᵀ · x_eᵀ, the tokens (the contraction) padded with zero columns to a
              multiple of 16 (`torch._scaled_mm`'s rule on CUDA; zeros change no amax and
              add nothing)

so an expert's scales depend on its own weight and on the tokens it was sent alone. The rows
are cut into segments, each scaled alone, by a scaling: `PerExpert` (here; serial, TP, CP)
cuts one per expert, `megalite.model.moe.fp8_sources.PerSource` (expert parallelism) one per
(expert, source rank), each scaled with its source's micro-batch's amaxes. Per expert, each
kind of amax is taken for all E experts at once, an [E] fp32 vector (0 for an expert without
rows), and max-reduced where the serial run's tensor spans more than this rank's piece, as
the dense recipe reduces a linear's (`megalite.parallel.fp8`; `Fp8Linear` says the split):

    TP (`layer.group`; the experts split like the dense MLP, MoE's tokens gathered under SP)
        every W_e (gate_up by rows, down by columns); down's input (silu(gate)·up, its
        columns split) and gate_up's output gradient (likewise). gate_up's input and down's
        output gradient are the gathered tokens', the same on every TP rank: not reduced.
    CP (`layer.token_group`; each CP rank holds other tokens of the sequences)
        every token tensor: x_e of both products and dy_e of both backward products.

so every rank scales each element of each expert's operands as the serial run does, whatever
tokens it holds. The reductions are one all-reduce of [E] per kind and group, launched on
every rank in the same order whatever the routing sent it (an expert that got rows on one
rank and none on another still takes part). As in the dense recipe the function saves the
high-precision rows and weight and casts them again in backward (the FP8 copies live for one
product), keeping the forward's two amax vectors and taking dy's once for both backward
products. A segment without rows computes nothing; an expert's weight gradient is the sum of
its segments' (zero without rows). The router,
its scores and the combine never come here: they stay in fp32 and the model dtype.

The products run expert by expert whatever `experts_impl` says: PyTorch's grouped FP8 kernel
(`torch._scaled_grouped_mm`) takes row-wise scales only.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel import comm
from megalite.parallel.fp8 import E4M3, E5M2, Fp8Linear, scaled_product
from megalite.parallel.group import Group

TOKEN_MULTIPLE = 16


def _reduced(amaxes: torch.Tensor, groups) -> torch.Tensor:
    """`amaxes` [E] max-reduced in place over each of `groups` that is given."""
    for group in groups:
        if group is not None:
            comm.all_reduce(amaxes, group, op=dist.ReduceOp.MAX)
    return amaxes


def _token_group(layer: Fp8Linear) -> Optional[Group]:
    cp = layer.token_group
    return cp if cp is not None and cp.size > 1 else None


class PerExpert:
    """The serial scaling (and TP's and CP's): one segment of rows per expert, its token
    amaxes reduced over the groups the serial tensor spans (module docstring)."""

    def __init__(self, counts: List[int]):
        self.sizes, self.experts = counts, list(range(len(counts)))

    def token_amaxes(self, rows: torch.Tensor, tp_split: bool, layer: Fp8Linear) -> torch.Tensor:
        """Each expert's amax of its rows of the expert-major `rows` [N, C]: [E] fp32, 0 where
        an expert has none, over TP where `tp_split` (the columns are split) and over CP."""
        return _reduced(segment_amaxes(rows, self.sizes),
                        (layer.amax_group(tp_split, False), _token_group(layer)))

    def weight_amaxes(self, weight: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
        """Each expert's weight amax of `weight` [E, M, K]: [E] fp32, over TP (every expert
        weight is split)."""
        amaxes = torch.stack([w.abs().amax().float() for w in weight])  # one copy at a time
        return _reduced(amaxes, (layer.amax_group(True, False),))


def segment_amaxes(rows: torch.Tensor, sizes: List[int]) -> torch.Tensor:
    """The fp32 amax of each consecutive segment of `sizes` rows of `rows` (0 for an empty
    one)."""
    zero = rows.new_zeros((), dtype=torch.float32)
    return torch.stack([part.abs().amax().float() if part.shape[0] else zero
                        for part in rows.split(sizes)])


def _padded_tokens(t: torch.Tensor) -> torch.Tensor:
    """t [C, n] with zero columns up to a multiple of TOKEN_MULTIPLE tokens."""
    return F.pad(t, (0, -t.shape[1] % TOKEN_MULTIPLE))


class _Fp8ExpertProducts(torch.autograd.Function):
    """rows [N, K] (expert-major, cut into `scaling`'s segments) · weight [E, M, K] per expert
    -> [N, M] (module docstring); `layer` the split (column: gate_up, else down)."""

    @staticmethod
    def forward(ctx, rows, weight, scaling, layer: Fp8Linear):
        ctx.save_for_backward(rows, weight)
        ctx.scaling, ctx.layer = scaling, layer
        ctx.amaxes = (scaling.token_amaxes(rows, not layer.column, layer),
                      scaling.weight_amaxes(weight, layer))
        outs = []
        for i, (e, part) in enumerate(zip(scaling.experts, rows.split(scaling.sizes))):
            if part.shape[0] == 0:
                continue
            outs.append(scaled_product(part, weight[e], (E4M3, E4M3), layer, (None, None),
                                       rows.dtype, (ctx.amaxes[0][i], ctx.amaxes[1][e])))
        return torch.cat(outs) if outs else rows.new_zeros(0, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        layer, scaling = ctx.layer, ctx.scaling
        x_amax, w_amax = ctx.amaxes
        dy_amax = scaling.token_amaxes(grad, layer.column, layer)
        grad_rows = []
        grad_weight = torch.zeros_like(weight)
        segments = zip(scaling.experts, rows.split(scaling.sizes), grad.split(scaling.sizes))
        for i, (e, part, dy) in enumerate(segments):
            if part.shape[0] == 0:
                continue
            grad_rows.append(scaled_product(dy, weight[e].t(), (E5M2, E4M3), layer,
                                            (None, None), rows.dtype, (dy_amax[i], w_amax[e])))
            grad_weight[e] += scaled_product(
                _padded_tokens(dy.t()), _padded_tokens(part.t()), (E5M2, E4M3), layer,
                (None, None), weight.dtype, (dy_amax[i], x_amax[i]))
        grad_x = torch.cat(grad_rows) if grad_rows else torch.zeros_like(rows)
        return grad_x, grad_weight, None, None


def fp8_expert_products(rows: torch.Tensor, weight: torch.Tensor, scaling,
                        layer: Fp8Linear) -> torch.Tensor:
    """rows [N, K], cut into the segments of `scaling` (`PerExpert`: expert e's rows the e-th
    of its counts; under EP `megalite.model.moe.fp8_sources.PerSource`), times each expert's
    W_e [M, K] of `weight` [E, M, K], transposed: [N, M], every product in FP8 (module
    docstring); `layer`: the recipe and how the product is split (column: gate_up, the input
    the same on every TP rank; row: down, its input's columns split; its token group: CP)."""
    return _Fp8ExpertProducts.apply(rows, weight, scaling, layer)
