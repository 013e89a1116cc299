"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019 §3; sequence parallelism,
Korthikanti et al. 2022 §4). Activations are [s, b, h]; with sequence parallelism the
activations between TP regions are [s/tp, b, h] shards of the sequence.

All TP/SP communication goes through the five autograd regions of `megalite.parallel.regions`:

    ColumnParallelLinear   x -> copy_to_tp (or gather_from_seq with SP, re-gathered in
                           backward instead of kept) -> x W_r^T + b_r
    column_parallel_linears  the same for several weights of one input (Llama's q, k, v):
                           one copy_to_tp / all-gather, one x W_i^T each
    RowParallelLinear      x_r W_r^T -> reduce_from_tp (or reduce_scatter_to_seq with SP) -> + b
    VocabParallelEmbedding rows of this rank's vocab slice -> reduce_from_tp / reduce_scatter

The loss on logits split over the vocabulary (max, target logit and sum of exponentials
reduced across TP, never the logits themselves; in chunks of tokens) is
`megalite.parallel.cross_entropy`.

Zero-bubble schedules split each backward into B (input gradient) and W (weight gradient, run
later): the layers here take a `weight_grad_queue` (`megalite.parallel.weight_grad`); without
one they compute both at once, as plain autograd does.

Weights are stored as nn.Linear does, [out, in]; the `ParamSpec` of each parameter says how it
relates to the global tensor (see `megalite.parallel.param_spec`).

A linear whose `fp8` names a recipe (`megalite.parallel.fp8.use_fp8`) runs its products in
FP8 (`megalite.parallel.fp8`), inside the same communication regions.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.parallel import comm, regions
from megalite.parallel.fp8 import Fp8Linear, fp8_linear
from megalite.parallel.group import Group
from megalite.parallel.weight_grad import (
    WeightGradQueue,
    defer_or_run,
    linear_weight_grads,
    split_embedding,
    split_linear,
)


class _SequenceParallelLinear(torch.autograd.Function):
    """y = all_gather_seq(x) W^T + b, saving only the local shard x for backward and gathering
    it again there (Korthikanti et al. 2022 §4.2.2): the full-sequence input never stays alive,
    so a layer's activations are 1/tp of the replicated case, at one more all-gather per layer.

        forward : X = all-gather(x) along the sequence; y = X W^T + b
        backward: X = all-gather(x) again; dW = dy^T X, db = sum dy;
                  dx = reduce-scatter(dy W) along the sequence

    Split for zero-bubble schedules (`queue` collecting, `megalite.parallel.weight_grad`): B
    computes dx only (dy W needs no X, so B gathers nothing) and W re-gathers X from the kept
    shard. The deferred W keeps the shard x [s/tp, b, in] and dy [s, b, out/tp] until it runs
    — 1/tp of the gathered input, the same as the unsplit backward keeps — and the layer still
    gathers X once per backward, in W instead of B: no more traffic than unsplit.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group: Group, params=None, queue=None):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.params, ctx.queue = group, bias is not None, params, queue
        return F.linear(comm.gather_seq(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group = ctx.group
        if ctx.queue is not None:  # split: the parameters came in detached
            (w, b), sequence_shard = ctx.params, x
            defer_or_run(ctx.queue, lambda: linear_weight_grads(
                grad, comm.gather_seq(sequence_shard, group), w, b))
            grad_x = comm.reduce_scatter_seq(grad.matmul(weight), group)
            return grad_x, None, None, None, None, None
        total = comm.gather_seq(x, group)
        grad_x = comm.reduce_scatter_seq(grad.matmul(weight), group)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = g2.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None


def _sequence_parallel_linear(x, weight, bias, group: Group,
                              queue: Optional[WeightGradQueue]) -> torch.Tensor:
    if queue is None:
        return _SequenceParallelLinear.apply(x, weight, bias, group)
    return _SequenceParallelLinear.apply(x, weight.detach(), None if bias is None else
                                         bias.detach(), group, (weight, bias), queue)


class _SequenceParallelLinears(torch.autograd.Function):
    """y_i = all_gather_seq(x) W_i^T for several weights of one input: `_SequenceParallelLinear`
    with the gathered input shared — one all-gather in forward, one more in backward (or in
    W, split), and one reduce-scatter of dx = Σ_i dy_i W_i — as one fused weight would have,
    while each W_i stays a parameter of its own (its own spec: grouped-query attention's K and
    V may be shared by TP ranks where Q is split)."""

    @staticmethod
    def forward(ctx, x, group: Group, params, queue, *weights):
        ctx.save_for_backward(x, *weights)
        ctx.group, ctx.params, ctx.queue = group, params, queue
        total = comm.gather_seq(x, group)
        return tuple(F.linear(total, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        group = ctx.group
        grad_x = sum(g.matmul(w) for g, w in zip(grads, weights))
        grad_x = comm.reduce_scatter_seq(grad_x, group)
        if ctx.queue is not None:  # split: the parameters came in detached
            params, shard = ctx.params, x

            def weight_grads():
                total = comm.gather_seq(shard, group)
                return [pair for g, w in zip(grads, params)
                        for pair in linear_weight_grads(g, total, w, None)]
            defer_or_run(ctx.queue, weight_grads)
            return (grad_x, None, None, None) + (None,) * len(weights)
        total = comm.gather_seq(x, group).reshape(-1, x.shape[-1])
        grad_ws = [g.reshape(-1, g.shape[-1]).t().matmul(total) for g in grads]
        return (grad_x, None, None, None, *grad_ws)


def column_parallel_linears(x: torch.Tensor, weights: List[torch.Tensor], group: Group,
                            sequence_parallel: bool,
                            queue: Optional[WeightGradQueue] = None) -> List[torch.Tensor]:
    """x W_i^T for each of `weights` (column-parallel, no biases), the input copied to TP (or,
    with SP, gathered along the sequence) once for all of them; with `queue` (a zero-bubble
    schedule) the weight gradients can be deferred to the schedule's W."""
    if sequence_parallel and group.size > 1:
        if queue is None:
            return list(_SequenceParallelLinears.apply(x, group, None, None, *weights))
        return list(_SequenceParallelLinears.apply(x, group, list(weights), queue,
                                                   *[w.detach() for w in weights]))
    x = regions.copy_to_tp(x, group)
    if queue is not None:
        return [split_linear(x, w, None, queue) for w in weights]
    return [F.linear(x, w) for w in weights]


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r, W split by output features: TP rank r computes its slice of y.

    The input is replicated ([s, b, in]; backward all-reduces dL/dx over TP) or, with sequence
    parallelism, a sequence shard [s/tp, b, in] that is all-gathered first (backward
    reduce-scatters dL/dx; only the shard is kept for backward, see _SequenceParallelLinear).
    The output stays split: [s, b, out/tp].
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Group,
                 sequence_parallel: bool, bias: bool = True):
        super().__init__()
        tp = tp_group.size
        if out_features % tp:
            raise ValueError(f"output features {out_features} not divisible by tp={tp}")
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp)) if bias else None
        self.weight_grad_queue: Optional[WeightGradQueue] = None  # zero-bubble: W deferred
        self.fp8: Optional[str] = None  # an FP8 recipe (megalite.parallel.fp8)
        self.fp8_token_group: Optional[Group] = None  # CP: amaxes over the other tokens too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            sp = self.sequence_parallel and self.tp_group.size > 1
            layer = Fp8Linear(self.fp8, self.tp_group, column=True, gather=sp,
                              token_group=self.fp8_token_group)
            return fp8_linear(x if sp else regions.copy_to_tp(x, self.tp_group), self.weight,
                              self.bias, layer, self.weight_grad_queue)
        return column_parallel_linear(x, self.weight, self.bias, self.tp_group,
                                      self.sequence_parallel, self.weight_grad_queue)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           group: Group, sequence_parallel: bool,
                           queue: Optional[WeightGradQueue] = None) -> torch.Tensor:
    """The column-parallel product (the linear above; also the LM head, whose weight is the
    vocab-parallel embedding). With `queue` (a zero-bubble schedule) the weight gradient can
    be deferred to the schedule's W (`megalite.parallel.weight_grad`)."""
    if sequence_parallel and group.size > 1:
        return _sequence_parallel_linear(x, weight, bias, group, queue)
    if queue is not None:
        return split_linear(regions.copy_to_tp(x, group), weight, bias, queue)
    return F.linear(regions.copy_to_tp(x, group), weight, bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b, W split by input features; x_r is the column-parallel output.

    The partial products are summed across TP (all-reduce, or reduce-scatter along the sequence
    with SP, giving [s/tp, b, out]); the bias, replicated, is added once after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Group,
                 sequence_parallel: bool, bias: bool = True):
        super().__init__()
        tp = tp_group.size
        if in_features % tp:
            raise ValueError(f"input features {in_features} not divisible by tp={tp}")
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight_grad_queue: Optional[WeightGradQueue] = None  # zero-bubble: W deferred
        self.fp8: Optional[str] = None  # an FP8 recipe (megalite.parallel.fp8)
        self.fp8_token_group: Optional[Group] = None  # CP: amaxes over the other tokens too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queue = self.weight_grad_queue
        if self.fp8 is not None:
            layer = Fp8Linear(self.fp8, self.tp_group, column=False,
                              token_group=self.fp8_token_group)
            y = fp8_linear(x, self.weight, None, layer, queue)
        else:
            y = F.linear(x, self.weight) if queue is None else \
                split_linear(x, self.weight, None, queue)
        y = regions.reduce_scatter_to_seq(y, self.tp_group) if self.sequence_parallel \
            else regions.reduce_from_tp(y, self.tp_group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose (padded) rows are split over TP: rank r holds rows
    [r·V/tp, (r+1)·V/tp). Ids outside the slice look up zeros; summing across TP gives every
    rank the full embedding ([s, b, h]), or with SP its sequence shard ([s/tp, b, h])."""

    def __init__(self, padded_vocab: int, dim: int, tp_group: Group, sequence_parallel: bool):
        super().__init__()
        tp = tp_group.size
        if padded_vocab % tp:
            raise ValueError(f"vocabulary {padded_vocab} not divisible by tp={tp}")
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.rows = padded_vocab // tp
        self.start = tp_group.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))
        self.weight_grad_queue: Optional[WeightGradQueue] = None  # zero-bubble: W deferred

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_grad_queue is None:
            return F.embedding(ids, self.weight)
        return split_embedding(ids, self.weight, self.weight_grad_queue)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            out = self._lookup(ids)
        else:
            local = ids - self.start
            outside = (local < 0) | (local >= self.rows)
            out = self._lookup(local.masked_fill(outside, 0))
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return regions.reduce_scatter_to_seq(out, self.tp_group) if self.sequence_parallel \
            else regions.reduce_from_tp(out, self.tp_group)


def gather_vocab(logits: torch.Tensor, group: Group, vocab_size: int) -> torch.Tensor:
    """All TP ranks' logit slices [..., V/tp] joined along the vocabulary and unpadded
    ([..., vocab_size]); for inference and tests, never for the training loss."""
    if group.size > 1:
        out = torch.empty((group.size, *logits.shape), dtype=logits.dtype, device=logits.device)
        comm.all_gather(out.view(group.size * logits.shape[0], *logits.shape[1:]),
                        logits.contiguous(), group)
        logits = torch.cat(list(out.unbind(0)), dim=-1)
    return logits[..., :vocab_size]


def sequence_chunk(length: int, group: Optional[Group], sequence_parallel: bool) -> range:
    """Positions [start, end) of the sequence held by this rank."""
    if not sequence_parallel or group is None or group.size == 1:
        return range(length)
    chunk = length // group.size
    return range(group.rank * chunk, (group.rank + 1) * chunk)
