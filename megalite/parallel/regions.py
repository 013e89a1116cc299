"""The autograd regions of tensor and sequence parallelism (Shoeybi et al. 2019; Korthikanti
et al. 2022): all TP/SP communication of the layers (`megalite.parallel.tensor`) goes through
these five functions (no-ops on a group of one).

    function               forward                          backward
    copy_to_tp (f)         identity                         all-reduce
    reduce_from_tp (g)     all-reduce                       identity
    scatter_to_seq         keep this rank's sequence chunk  all-gather along the sequence
    gather_from_seq        all-gather along the sequence    reduce-scatter along the sequence
    reduce_scatter_to_seq  reduce-scatter along sequence    all-gather along the sequence

Activations are [s, b, h]: the sequence is dim 0, so its chunks are contiguous and map
directly onto all_gather / reduce_scatter of flat tensors.
"""
from __future__ import annotations

import torch

from megalite.parallel.comm import all_reduce, gather_seq, reduce_scatter_seq, split_seq
from megalite.parallel.group import Group


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group), None


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToSeq.apply(x, group)


def gather_from_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromSeq.apply(x, group)


def reduce_scatter_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatterToSeq.apply(x, group)
