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

so an expert's scales depend on its own weight and on the tokens it was sent alone, and a
layout that gives the micro-batch's tokens to the experts as the serial run does quantizes
every element alike. As in the dense recipe the function saves the high-precision rows and
weight and casts them again in backward (the FP8 copies live for one product), keeping the
forward's two amaxes per expert (fp32 scalars) and taking dy_e's once for both backward
products. An expert without rows computes nothing; its weight gradient is zero. The router,
its scores and the combine never come here: they stay in fp32 and the model dtype.

The products run expert by expert whatever `experts_impl` says: PyTorch's grouped FP8 kernel
(`torch._scaled_grouped_mm`) takes row-wise scales only.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from megalite.parallel.fp8 import E4M3, E5M2, Fp8Linear, amax_of, scaled_product
from megalite.parallel.group import single_rank_group

TOKEN_MULTIPLE = 16


def _tensorwise() -> Fp8Linear:
    """The recipe of every product here: each operand's scale over its whole tensor, reduced
    over no group (the experts are not split)."""
    return Fp8Linear("tensorwise", single_rank_group("experts"), column=True)


def _amax(t: torch.Tensor) -> torch.Tensor:
    return amax_of(t, False, None)


def _padded_tokens(t: torch.Tensor) -> torch.Tensor:
    """t [C, n] with zero columns up to a multiple of TOKEN_MULTIPLE tokens."""
    return F.pad(t, (0, -t.shape[1] % TOKEN_MULTIPLE))


class _Fp8ExpertProducts(torch.autograd.Function):
    """rows [N, K] (expert-major, `counts` a host list) · weight [E, M, K] per expert -> [N, M]
    (module docstring)."""

    @staticmethod
    def forward(ctx, rows, weight, counts: List[int]):
        ctx.save_for_backward(rows, weight)
        ctx.counts, ctx.amaxes, ctx.recipe = counts, {}, _tensorwise()
        outs = []
        for e, part in enumerate(rows.split(counts)):
            if part.shape[0] == 0:
                continue
            ctx.amaxes[e] = (_amax(part), _amax(weight[e]))
            outs.append(scaled_product(part, weight[e], (E4M3, E4M3), ctx.recipe, (None, None),
                                       rows.dtype, ctx.amaxes[e]))
        return torch.cat(outs) if outs else rows.new_zeros(0, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        grad_rows, recipe = [], ctx.recipe
        grad_weight = torch.zeros_like(weight)
        for e, (part, dy) in enumerate(zip(rows.split(ctx.counts), grad.split(ctx.counts))):
            if part.shape[0] == 0:
                continue
            x_amax, w_amax = ctx.amaxes[e]
            dy_amax = _amax(dy)
            grad_rows.append(scaled_product(dy, weight[e].t(), (E5M2, E4M3), recipe,
                                            (None, None), rows.dtype, (dy_amax, w_amax)))
            grad_weight[e] = scaled_product(
                _padded_tokens(dy.t()), _padded_tokens(part.t()), (E5M2, E4M3), recipe,
                (None, None), weight.dtype, (dy_amax, x_amax))
        grad_x = torch.cat(grad_rows) if grad_rows else torch.zeros_like(rows)
        return grad_x, grad_weight, None


def fp8_expert_products(rows: torch.Tensor, weight: torch.Tensor,
                        counts: List[int]) -> torch.Tensor:
    """rows [N, K], expert e's the e-th `counts` of them, times each expert's W_e [M, K] of
    `weight` [E, M, K], transposed: [N, M], every product in FP8 (module docstring)."""
    return _Fp8ExpertProducts.apply(rows, weight, counts)
