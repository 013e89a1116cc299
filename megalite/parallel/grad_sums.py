"""The sums after the DP reduction, on this rank's owned range (`ZeroEngine.finish_grad_sync`):

    tied embedding   pp > 1: the embedding's two copies (first and last pipeline stage, each a
                     bucket of its own, owning the same elements) summed over the embedding
                     group, every element once — offloaded elements too (`OptimizerOffload
                     .sum_tied`)
    TP-replicated    sequence parallelism gives each TP rank part of the sequence, so the
                     gradients of TP-replicated parameters (LayerNorms, row-parallel biases)
                     are partial sums: one all-reduce over TP of all of them, host pieces
                     through the device
    TP-shared        a slice several TP ranks hold alike (`ParamSpec.tp_replicas` = k:
                     grouped-query attention's KV heads with tp > n_kv_head) gets from each of
                     the k the gradient of its own query heads: summed over the k, in one
                     all-reduce over TP of a buffer with a slot per group of k

The three sets are disjoint (the tied embedding is vocabulary-parallel, never TP-replicated or
shared), so their order does not change a sum; the tied one comes first because under zero 0/1
it relies on the device's gradient still holding the host part's values as copied.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megalite.parallel import comm
from megalite.parallel.group import Group


def sum_tied_embedding(buckets: List, offload, topo) -> None:
    """Sum the tied embedding buckets' gradients over `topo`'s embedding group. Under zb-v
    the embedding is one parameter on one rank: no bucket is tied and no group exists."""
    for b in buckets:
        if not b.tied:
            continue
        group = topo.embedding_group
        if offload is None:
            comm.all_reduce(b.main_grad, group)
        else:
            offload.sum_tied(b, group, comm.all_reduce)


def sum_tp_replicated(main_params: List, group: Group, device: torch.device) -> None:
    """Sum the TP-replicated master pieces' gradients over TP (`main_params`: the engine's
    (piece, segment, bucket) triples), in one all-reduce through `device`."""
    pieces: Optional[List[torch.Tensor]] = [p.grad for p, s, _ in main_params
                                            if s.spec.tp_replicated]
    if not pieces:
        return
    flat = torch.cat([g.to(device) for g in pieces])  # offloaded ones: via the device
    comm.all_reduce(flat, group)
    for g, summed in zip(pieces, flat.split([g.numel() for g in pieces])):
        g.copy_(summed)


def sum_tp_shares(main_params: List, group: Group, device: torch.device) -> None:
    """Sum the gradients of the master pieces of TP-shared slices (`ParamSpec.tp_replicas` =
    k > 1) over the k TP ranks that hold each slice: every TP rank of a (pp, dp) position has
    the same pieces (equal local shapes, equal buckets, equal ZeRO ranges), so rank r writes
    its values into slot r // k of a zero buffer with tp / k slots, one all-reduce over TP
    sums each slot over its k ranks, and rank r reads its slot back."""
    pieces = [(p.grad, s.spec.tp_replicas) for p, s, _ in main_params if s.spec.tp_replicas > 1]
    if not pieces:
        return
    k = pieces[0][1]
    if any(r != k for _, r in pieces):
        raise ValueError(f"TP-shared parameters with different tp_replicas: "
                         f"{sorted({r for _, r in pieces})}")
    flat = torch.cat([g.reshape(-1).to(device) for g, _ in pieces])
    slots = flat.new_zeros(group.size // k, flat.numel())
    slots[group.rank // k] = flat
    comm.all_reduce(slots, group)
    mine = slots[group.rank // k]
    for (g, _), summed in zip(pieces, mine.split([g.numel() for g, _ in pieces])):
        g.copy_(summed.view_as(g))
