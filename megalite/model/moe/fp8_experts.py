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

so an expert's scales depend on its own weight and on the tokens it was sent alone. Each kind
of amax is taken for all E experts at once, an [E] fp32 vector (0 for an expert without
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
products. An expert without rows computes nothing; its weight gradient is zero. The router,
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


def token_amaxes(rows: torch.Tensor, counts: List[int], tp_split: bool,
                 layer: Fp8Linear) -> torch.Tensor:
    """Each expert's amax of its rows of the expert-major `rows` [N, C] (`counts` a host
    list): [E] fp32, 0 where an expert has none, over TP where `tp_split` (the columns are
    split) and over CP (module docstring)."""
    zero = rows.new_zeros((), dtype=torch.float32)
    amaxes = torch.stack([part.abs().amax().float() if part.shape[0] else zero
                          for part in rows.split(counts)])
    return _reduced(amaxes, (layer.amax_group(tp_split, False), _token_group(layer)))


def weight_amaxes(weight: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """Each expert's weight amax of `weight` [E, M, K]: [E] fp32, over TP (every expert
    weight is split)."""
    amaxes = torch.stack([w.abs().amax().float() for w in weight])  # one expert's copy at a time
    return _reduced(amaxes, (layer.amax_group(True, False),))


def _padded_tokens(t: torch.Tensor) -> torch.Tensor:
    """t [C, n] with zero columns up to a multiple of TOKEN_MULTIPLE tokens."""
    return F.pad(t, (0, -t.shape[1] % TOKEN_MULTIPLE))


class _Fp8ExpertProducts(torch.autograd.Function):
    """rows [N, K] (expert-major, `counts` a host list) · weight [E, M, K] per expert -> [N, M]
    (module docstring); `layer` the split (column: gate_up, else down)."""

    @staticmethod
    def forward(ctx, rows, weight, counts: List[int], layer: Fp8Linear):
        ctx.save_for_backward(rows, weight)
        ctx.counts, ctx.layer = counts, layer
        ctx.amaxes = (token_amaxes(rows, counts, not layer.column, layer),
                      weight_amaxes(weight, layer))
        outs = []
        for e, part in enumerate(rows.split(counts)):
            if part.shape[0] == 0:
                continue
            outs.append(scaled_product(part, weight[e], (E4M3, E4M3), layer, (None, None),
                                       rows.dtype, (ctx.amaxes[0][e], ctx.amaxes[1][e])))
        return torch.cat(outs) if outs else rows.new_zeros(0, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        layer, counts = ctx.layer, ctx.counts
        x_amax, w_amax = ctx.amaxes
        dy_amax = token_amaxes(grad, counts, layer.column, layer)
        grad_rows = []
        grad_weight = torch.zeros_like(weight)
        for e, (part, dy) in enumerate(zip(rows.split(counts), grad.split(counts))):
            if part.shape[0] == 0:
                continue
            grad_rows.append(scaled_product(dy, weight[e].t(), (E5M2, E4M3), layer,
                                            (None, None), rows.dtype, (dy_amax[e], w_amax[e])))
            grad_weight[e] = scaled_product(
                _padded_tokens(dy.t()), _padded_tokens(part.t()), (E5M2, E4M3), layer,
                (None, None), weight.dtype, (dy_amax[e], x_amax[e]))
        grad_x = torch.cat(grad_rows) if grad_rows else torch.zeros_like(rows)
        return grad_x, grad_weight, None, None


def fp8_expert_products(rows: torch.Tensor, weight: torch.Tensor, counts: List[int],
                        layer: Fp8Linear) -> torch.Tensor:
    """rows [N, K], expert e's the e-th `counts` of them, times each expert's W_e [M, K] of
    `weight` [E, M, K], transposed: [N, M], every product in FP8 (module docstring); `layer`:
    the recipe and how the product is split (column: gate_up, the input the same on every TP
    rank; row: down, its input's columns split; its token group: CP)."""
    return _Fp8ExpertProducts.apply(rows, weight, counts, layer)
