"""The sums after the DP reduction, on this rank's owned range (`ZeroEngine.finish_grad_sync`):

    tied embedding   pp > 1: the embedding's two copies (first and last pipeline stage, each a
                     bucket of its own, owning the same elements) summed over the embedding
                     group, every element once — offloaded elements too (`OptimizerOffload
                     .sum_tied`)
    TP-replicated    sequence parallelism gives each TP rank part of the sequence, so the
                     gradients of TP-replicated parameters (LayerNorms, row-parallel biases)
                     are partial sums: one all-reduce over TP of all of them, host pieces
                     through the device

The two sets are disjoint (the tied embedding is vocabulary-parallel, never TP-replicated), so
their order does not change a sum; the tied one comes first because under zero 0/1 it relies on
the device's gradient still holding the host part's values as copied.
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
