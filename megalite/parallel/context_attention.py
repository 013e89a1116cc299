"""Causal attention over a sequence sharded across the context-parallel (CP) group.

Each CP rank holds two chunks of every sequence (`context_shard`: chunks r and 2·cp − 1 − r of
2·cp) and computes attention for its own queries against the keys of the whole sequence. Two
ways, `parallel.cp_comm`:

  allgather  K and V are all-gathered over CP (one collective, only the KV heads: cheap under
             grouped-query attention, which the attention kernel runs without repeating K/V)
             and each local query chunk attends to the keys up to its own chunk without a
             mask: on CPU the keys before the chunk and the chunk's own (causally) are two
             flash calls merged by their log-sum-exp (`context_partial`), elsewhere SDPA
             with `causal_lower_right`; under document masking SDPA with a boolean mask. In
             backward the gathered K/V gradients are reduce-scattered back to their owners.
             Llama 3's choice (Dubey et al. 2024, §3.3.2).
  ring       K/V blocks travel around the CP ring and the partial results are merged by
             their log-sum-exp (Liu et al. 2023, Ring Attention; `megalite.parallel.
             context_ring`).

Both skip the (query chunk, key chunk) pairs that causality masks entirely: a chunk attends
to the chunks before it in full and to itself causally.

Document masking (`train.attention_mask=document`): `documents` [b, local tokens] gives each
local token its document's global id (ids non-decreasing along the sequence, as
`megalite.data.documents` numbers them), and query t sees key u iff u <= t and their ids are
equal. The ids travel with the keys (gathered with K/V, or passed round the ring with each
block). Because ids only grow along the sequence, a key chunk before a query chunk is masked
entirely when its last id is below the query chunk's first (in every sequence of the batch):
the ring skips such pairs, forward and backward; the all-gather path starts each query chunk's
keys at the first key of its first document. `AttentionWork` counts the (query, key) scores
computed and skipped against the causal plan (per head, summed over the batch), when given.

Tensors are [batch, heads, local tokens, head dim]; q has `hq` heads, k and v `hk` (hq a
multiple of hk: grouped-query attention, each KV head serving hq / hk query heads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from megalite.parallel import context_shard
from megalite.parallel.comm import all_gather, reduce_scatter
from megalite.parallel.context_partial import (
    AttentionWork,
    accumulated,
    merge_partial,
    same_document,
)
from megalite.parallel.context_ring import RingAttention
from megalite.parallel.group import Group

CP_COMMS = ("allgather", "ring")


@dataclass(frozen=True)
class ContextParallel:
    """This rank's CP group and how attention communicates over it (`parallel.cp_comm`)."""

    group: Group
    comm: str = "allgather"

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """The global positions of this rank's `local_len` tokens of a sequence."""
        n = self.group.size
        return context_shard.positions(local_len * n, n, self.group.rank, device)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                 comm: str = "allgather", scale: Optional[float] = None,
                 documents: Optional[torch.Tensor] = None,
                 work: Optional[AttentionWork] = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole CP-sharded sequence; with
    `documents` [b, local tokens] (global document ids of this rank's tokens) within each
    document only. `work`, when given, accumulates the scores computed and skipped."""
    if comm not in CP_COMMS:
        raise ValueError(f"CP attention comm={comm!r}: use one of {', '.join(CP_COMMS)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if q.shape[2] != k.shape[2] or k.shape != v.shape or q.shape[2] % 2:
        raise ValueError(f"CP attention takes this rank's two chunks of every sequence: q {q.shape}, "
                         f"k {k.shape}, v {v.shape} (the same even token count)")
    if documents is not None and tuple(documents.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"CP attention's document ids {tuple(documents.shape)}: one per local "
                         f"token of every sequence, [{q.shape[0]}, {q.shape[2]}]")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    work = work if work is not None else AttentionWork()
    if group.size == 1:
        return _local_attention(q, k, v, documents, scale, work)
    if comm == "allgather":
        return _allgather_attention(q, k, v, group, scale, documents, work)
    return RingAttention.apply(q, k, v, group, scale, documents, work)


def _local_attention(q, k, v, documents, scale: float, work: AttentionWork) -> torch.Tensor:
    """cp = 1: the whole sequence is local (its two chunks in order)."""
    n = q.shape[2]
    work.computed += q.shape[0] * n * (n + 1) // 2
    if documents is None:
        return _sdpa(q, k, v, None, scale, causal=True)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return _sdpa(q, k, v, (causal & same_document(documents, documents))[:, None], scale)


def _sdpa(q, k, v, mask, scale, causal=False):
    """SDPA; under grouped-query attention each KV head serves its query heads in the kernel
    (`enable_gqa`), no K/V repeated."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


# --- all-gather ------------------------------------------------------------------------------

class _GatherSequence(torch.autograd.Function):
    """[b, h, L, d] local -> [b, h, cp·L, d] in the sequence's order (all-gather over CP);
    backward: the gradient's owners' chunks, summed over CP (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        local = x.permute(2, 0, 1, 3).contiguous()  # sequence first: the collectives' dim 0
        out = local.new_empty((local.shape[0] * group.size, *local.shape[1:]))
        all_gather(out, local, group)
        return context_shard.unshard(out, group.size, dim=0).permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        full = context_shard.reshard(grad.permute(2, 0, 1, 3), group.size, dim=0).contiguous()
        out = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))
        reduce_scatter(out, full, group)
        return out.permute(1, 2, 0, 3), None


def _gather_ids(ids: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's document ids [b, L] -> the sequence's [b, cp·L] (no gradient)."""
    local = ids.t().contiguous()
    out = local.new_empty((local.shape[0] * group.size, local.shape[1]))
    all_gather(out, local, group)
    return context_shard.unshard(out, group.size, dim=0).t()


def _allgather_attention(q, k, v, group: Group, scale: float, documents,
                         work: AttentionWork) -> torch.Tensor:
    hk, b, c = k.shape[1], q.shape[0], q.shape[2] // 2
    kv = _GatherSequence.apply(torch.cat([k, v], dim=1), group)
    chunks = context_shard.chunk_ids(group.size, group.rank)
    if documents is None:
        work.computed += sum(b * c * (j + 1) * c for j in chunks)
        if q.device.type == "cpu":
            return _PrefixAttention.apply(q, kv, hk, chunks, scale)
        return torch.cat([_sdpa(q[:, :, i * c:(i + 1) * c], kv[:, :hk, :(j + 1) * c],
                                kv[:, hk:, :(j + 1) * c], causal_lower_right(c, (j + 1) * c), scale)
                          for i, j in enumerate(chunks)], dim=2)
    k_all, v_all = kv[:, :hk], kv[:, hk:]
    ids_all = _gather_ids(documents, group)
    outs = []
    for i, j in enumerate(chunks):
        end = (j + 1) * c  # keys after chunk j: all masked
        q_ids = documents[:, i * c:(i + 1) * c]  # keys before the chunk's first document: none
        start = int(torch.searchsorted(ids_all[:, :end].contiguous(),
                                       q_ids[:, :1].contiguous()).min())
        q_pos = torch.arange(j * c, end, device=q.device)
        k_pos = torch.arange(start, end, device=q.device)
        mask = (k_pos[None, :] <= q_pos[:, None]) & same_document(q_ids, ids_all[:, start:end])
        work.computed += b * c * (end - start)
        work.skipped += b * c * start
        outs.append(_sdpa(q[:, :, i * c:(i + 1) * c], k_all[:, :, start:end],
                          v_all[:, :, start:end], mask[:, None], scale))
    return torch.cat(outs, dim=2)


def _flash_cpu(q, k, v, causal: bool, scale: float):
    """CPU flash attention's (output, log-sum-exp), KV heads shared by their query heads."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)


class _PrefixAttention(torch.autograd.Function):
    """Each local query chunk (global chunk j of 2·cp, c tokens) over the gathered keys
    [0, (j + 1)·c) without a mask: the keys before the chunk in full and the chunk's own
    causally (top-left aligned), two flash calls merged by their log-sum-exp as in the ring.
    Saves the gathered K|V, the output and its log-sum-exp; backward runs the flash backward
    of each part against the merged output and log-sum-exp (the FlashAttention-2 backward of
    a key block under the full softmax). CPU only (the CPU flash kernel returns the
    log-sum-exp; elsewhere `causal_lower_right` keeps SDPA maskless)."""

    @staticmethod
    def forward(ctx, q, kv, hk: int, chunks, scale: float):
        c = q.shape[2] // 2
        outs, lses = [], []
        for i, j in enumerate(chunks):
            qi, k, v = q[:, :, i * c:(i + 1) * c], kv[:, :hk], kv[:, hk:]
            o, lse = _flash_cpu(qi, k[:, :, j * c:(j + 1) * c], v[:, :, j * c:(j + 1) * c],
                                True, scale)
            o = accumulated(o)
            if j:
                o_pre, lse_pre = _flash_cpu(qi, k[:, :, :j * c], v[:, :, :j * c], False, scale)
                o, lse = merge_partial(o, lse, accumulated(o_pre), lse_pre)
            outs.append(o.to(q.dtype))
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.hk, ctx.chunks, ctx.scale = hk, chunks, scale
        ctx.save_for_backward(q, kv, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        hk, scale, c = ctx.hk, ctx.scale, q.shape[2] // 2
        dq, dkv = torch.empty_like(q), torch.zeros_like(kv)
        k, v, dk, dv = kv[:, :hk], kv[:, hk:], dkv[:, :hk], dkv[:, hk:]
        for i, j in enumerate(ctx.chunks):
            part = slice(i * c, (i + 1) * c)
            args = (dout[:, :, part].contiguous(), q[:, :, part])
            tail = (out[:, :, part], lse[:, :, part], 0.0)
            for keys, causal in ((slice(j * c, (j + 1) * c), True), (slice(0, j * c), False)):
                if keys.stop == 0:
                    continue
                g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    *args, k[:, :, keys], v[:, :, keys], *tail, causal, scale=scale)
                dq[:, :, part] = g[0] if causal else accumulated(dq[:, :, part]) + accumulated(g[0])
                dk[:, :, keys] += g[1]
                dv[:, :, keys] += g[2]
        return dq, dkv, None, None, None
