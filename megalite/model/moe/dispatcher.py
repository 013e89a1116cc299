"""Token dispatch under expert parallelism (ep > 1): each EP rank routes its own tokens and
holds E/ep of the experts (EP rank r: experts [r·E/ep, (r+1)·E/ep), `Experts(ep=...)`); the
rows of the assignments travel to the rank of their expert and the outputs back. Two ways,
`parallel.ep_dispatch` (docs/moe.md):

  alltoall   (GShard, Lepikhin et al. 2020; Megatron-Core's MoEAlltoAllTokenDispatcher)
             1. the local dispatch (`experts.dispatch`: capacity per rank, as the anchors
                apply it) orders the kept assignments expert-major over all E experts, so
                the rows for EP rank j are one contiguous run;
             2. the counts per (destination, its local expert) are exchanged first (an
                all-to-all of E integers), which sizes the exchange of the rows;
             3. the rows are exchanged (all-to-all: source-major on arrival), permuted to
                expert-major for the grouped GEMM, computed, permuted back and returned by
                the reverse all-to-all;
             4. each token combines its experts' outputs weighted by the router's scores, in
                the serial order (`experts.combine`).
             Backward: the two all-to-alls swap their splits.
  allgather  (Megatron-Core's MoEAllGatherTokenDispatcher) every rank's tokens, routing
             weights and kept choices are all-gathered over EP (gradients reduce-scattered
             back); each rank computes its experts' assignments of all of them and combines
             its partial outputs, which a reduce-scatter sums and returns to the tokens'
             ranks (gradient: all-gathered).

Dropless unless model.moe.capacity_factor is set. The rows' numbers are known only after
routing, so the alltoall reads the exchanged counts on the host once per layer and forward
(as every dropless dispatcher does); an EP rank that receives no rows still runs its experts
on the empty rows (`Experts.compute`), so its gradient is zero, not absent. Both pass the
expert compute where its rows came from (`Sources`: rows per source and local expert, each
expert's source-major), which FP8 scales each source's by (`megalite.model.moe.fp8_sources`).
"""
from __future__ import annotations

from typing import List

import torch

from megalite.model.moe.experts import Dispatch, Experts, assignment_tokens, combine
from megalite.model.moe.fp8_sources import Sources
from megalite.parallel import comm
from megalite.parallel.group import Group
from megalite.parallel.regions import gather_from_seq, reduce_scatter_to_seq


class _AllToAll(torch.autograd.Function):
    """Rows [sum(in_splits), h] -> [sum(out_splits), h] over `group`; backward: the reverse
    exchange of the gradient."""

    @staticmethod
    def forward(ctx, rows, out_splits: List[int], in_splits: List[int], group: Group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        return comm.all_to_all(out, rows.contiguous(), group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        return comm.all_to_all(back, grad.contiguous(), ctx.group, in_splits, out_splits), \
            None, None, None


class TokenDispatcher:
    """The token exchange of a stage's MoE layers over the EP group `group` (`mode`: alltoall
    or allgather; module docstring)."""

    def __init__(self, group: Group, mode: str = "alltoall"):
        self.group, self.mode = group, mode

    @property
    def size(self) -> int:
        return self.group.size

    def __call__(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor,
                 indices: torch.Tensor, d: Dispatch) -> torch.Tensor:
        """This rank's tokens x [T, h], their routing (`weights`, `indices` [T, k]) and local
        dispatch `d` over all E experts -> the combined outputs [T, h]."""
        if self.mode == "allgather":
            return self._allgather(experts, x, weights, indices, d)
        return self._alltoall(experts, x, weights, d)

    def _alltoall(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor,
                  d: Dispatch) -> torch.Tensor:
        ep, group = self.group.size, self.group
        local = d.counts.numel() // ep
        tokens = assignment_tokens(d.order, weights.shape[1])
        sent = d.counts.view(ep, local)  # [destination, its local expert]
        received = torch.empty_like(sent)  # [source, my local expert]
        comm.all_to_all(received, sent.contiguous(), group)
        in_splits, out_splits = sent.sum(1).tolist(), received.sum(1).tolist()
        rows = _AllToAll.apply(x[tokens], out_splits, in_splits, group)
        expert = torch.arange(local, device=x.device).repeat(ep)
        expert = torch.repeat_interleave(expert, received.reshape(-1))
        perm = torch.argsort(expert, stable=True)  # source-major -> expert-major
        y = experts.compute(rows[perm], received.sum(0), Sources(received, group))
        y = y[torch.argsort(perm)]  # back to source-major, as the rows came
        y = _AllToAll.apply(y, in_splits, out_splits, group)
        return combine(x, y, weights, d.order, tokens)

    def _allgather(self, experts: Experts, x: torch.Tensor, weights: torch.Tensor,
                   indices: torch.Tensor, d: Dispatch) -> torch.Tensor:
        group, k = self.group, weights.shape[1]
        local = d.counts.numel() // group.size
        kept = torch.full_like(indices.reshape(-1), -1)  # dropped assignments: -1
        kept[d.order] = indices.reshape(-1)[d.order]
        choices = kept.new_empty(kept.numel() * group.size)
        comm.all_gather(choices, kept, group)
        x_all = gather_from_seq(x.contiguous(), group)
        w_all = gather_from_seq(weights.contiguous(), group)
        mine = choices - group.rank * local  # dropped (-1) and others' experts: outside
        mine = torch.where((mine >= 0) & (mine < local), mine, local)
        received = torch.zeros(group.size, local + 1, dtype=torch.long, device=x.device)
        received = received.scatter_add_(1, mine.view(group.size, -1), torch.ones_like(
            mine).view(group.size, -1))[:, :local]  # [source, my local expert]
        counts = received.sum(0)
        order = torch.argsort(mine, stable=True)[:int(counts.sum())]  # source-major in each
        tokens = assignment_tokens(order, k)
        y = experts.compute(x_all[tokens], counts, Sources(received, group))
        return reduce_scatter_to_seq(combine(x_all, y, w_all, order, tokens), group)
