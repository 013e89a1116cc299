"""Data-parallel engine over the DP group (the outermost dimension of [TP, PP, DP]).

Stage 0 so far: after the last micro-batch of a step, the gradients of all parameters are
averaged across DP ranks with all-reduces over flat buffers of at most `bucket_bytes`, once per
optimizer step (never per micro-batch). Overlapping those all-reduces with backward, and ZeRO
stages 1-3 (sharded optimizer state, gradients, parameters), land with the ZeRO issue.
"""
from __future__ import annotations

from typing import List

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megalite.parallel import comm
from megalite.parallel.comm import Group


def _buckets(tensors: List[torch.Tensor], bucket_bytes: int) -> List[List[torch.Tensor]]:
    out: List[List[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or size + nbytes > bucket_bytes or out[-1][0].dtype != t.dtype:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


class DataParallelGrads:
    """Averages gradients over the DP group: grad = (1/N) sum over replicas."""

    def __init__(self, params: List[torch.nn.Parameter], dp_group: Group,
                 bucket_bytes: int = 25 * 2**20):
        self.params = [p for p in {id(p): p for p in params}.values() if p.requires_grad]
        self.group = dp_group
        self.bucket_bytes = bucket_bytes

    @torch.no_grad()
    def sync(self) -> None:
        if self.group.size == 1:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        for bucket in _buckets(grads, self.bucket_bytes):
            flat = _flatten_dense_tensors(bucket)
            comm.all_reduce(flat, self.group)
            flat.div_(self.group.size)
            for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(synced)
