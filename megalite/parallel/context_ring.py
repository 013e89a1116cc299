"""The ring path of context-parallel attention (`parallel.cp_comm=ring`;
`megalite.parallel.context_attention` chooses it): K/V blocks travel around the CP ring (cp − 1
sends, each posted before the block in hand is computed) and the partial results are merged by
their log-sum-exp (Liu et al. 2023, Ring Attention; `megalite.parallel.context_partial`).
Backward passes the blocks round again, each with its dK/dV accumulator, which arrives back at
the block's owner after cp sends (the FlashAttention-2 backward per block: P = exp(S − lse),
dV = Pᵀ·dO, dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)), dQ = dS·K·scale, dK = dSᵀ·Q·scale).

The (query chunk, key chunk) pairs that causality masks entirely are skipped, and under the
document mask the off-diagonal pairs whose key chunk ends before the query chunk's first
document (in every sequence of the batch). The per-block product is the math form (scores of
one chunk pair at a time, accumulated in fp32 or the inputs' fp64), not a fused kernel.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megalite.parallel import context_shard
from megalite.parallel.comm import send_recv
from megalite.parallel.context_documents import DocumentSpans
from megalite.parallel.context_partial import (
    AttentionWork,
    accumulated,
    finite_lse,
    merge_partial,
)
from megalite.parallel.group import Group


def _pairs(cp: int, q_rank: int, kv_rank: int) -> List[Tuple[int, int, bool]]:
    """(local query chunk, key chunk of the block, causal) for the pairs with any work."""
    pairs = []
    for qi, qj in enumerate(context_shard.chunk_ids(cp, q_rank)):
        for ki, kj in enumerate(context_shard.chunk_ids(cp, kv_rank)):
            if kj <= qj:
                pairs.append((qi, ki, kj == qj))
    return pairs


def _scores(q, k, causal: bool, scale: float, visible: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
    """Scores of one chunk pair in the accumulation dtype, [b, hq, c, c]; k already expanded
    to hq heads; `visible` [b, c, c]: the keys in the queries' documents (None: no mask)."""
    s = torch.matmul(accumulated(q), accumulated(k).transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    if visible is not None:
        s = s.masked_fill(~visible[:, None], float("-inf"))
    return s


def _block_pairs(cp: int, q_rank: int, kv_rank: int, spans: Optional[DocumentSpans], c: int,
                 b: int, work: Optional[AttentionWork]):
    """The pairs of one ring step to compute, (local query chunk, key chunk of the block,
    causal, the key chunk's global index); under documents the off-diagonal pairs they mask
    in every sequence left out (counted in `work`), from the host's `chunk_first`."""
    q_chunks, kv_chunks = (context_shard.chunk_ids(cp, r) for r in (q_rank, kv_rank))
    pairs = []
    for qi, ki, causal in _pairs(cp, q_rank, kv_rank):
        if spans is not None and not causal \
                and spans.chunk_first[q_chunks[qi]] >= (kv_chunks[ki] + 1) * c:
            if work is not None:
                work.skipped += b * c * c
            continue
        if work is not None:
            work.computed += b * c * c
        pairs.append((qi, ki, causal, kv_chunks[ki]))
    return pairs


def _visible(spans: Optional[DocumentSpans], qi: int, kj: int, c: int):
    """The document mask of local query chunk `qi` over global key chunk `kj` (None without
    documents), made when its pair is computed."""
    if spans is None:
        return None
    return spans.visible(slice(qi * c, (qi + 1) * c), kj * c, c)


def _expand(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _fold(x: torch.Tensor, group: int) -> torch.Tensor:
    """The gradient of `_expand`: sum each KV head's query-head group."""
    if group == 1:
        return x
    b, h, n, d = x.shape
    return x.view(b, h // group, group, n, d).sum(2)


def _ring_step(group: Group, sends, recvs):
    """Post this step's ring transfers (to the next rank, from the previous)."""
    n, r = group.size, group.rank
    return send_recv([(t, (r + 1) % n) for t in sends], [(t, (r - 1) % n) for t in recvs],
                     group, async_op=True)


def _pass_on(group: Group, block: torch.Tensor, step: int):
    """Post the K/V block to the next rank and receive the previous rank's, except at the
    last step: (the pending transfer, the block to come)."""
    if step == group.size - 1:
        return None, None
    nxt = torch.empty_like(block)
    return _ring_step(group, [block], [nxt]), nxt


class RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group: Group, scale: float, spans: Optional[DocumentSpans],
                work: AttentionWork):
        n, r, hk = group.size, group.rank, k.shape[1]
        g, c = q.shape[1] // hk, q.shape[2] // 2
        qc = q.split(c, dim=2)
        out = [accumulated(torch.zeros_like(qc[0])) for _ in range(2)]
        lse = [torch.full_like(o[..., 0], float("-inf")) for o in out]
        block = torch.cat([k, v], dim=1).contiguous()
        for step in range(n):
            pending, nxt = _pass_on(group, block, step)
            kb, vb = (_expand(t, g).split(c, dim=2) for t in block.split(hk, dim=1))
            for qi, ki, causal, kj in _block_pairs(n, r, (r - step) % n, spans, c, q.shape[0],
                                                   work):
                s = _scores(qc[qi], kb[ki], causal, scale, _visible(spans, qi, kj, c))
                lse_blk = torch.logsumexp(s, dim=-1)
                o_blk = torch.matmul(torch.exp(s - finite_lse(lse_blk)[..., None]), accumulated(vb[ki]))
                out[qi], lse[qi] = merge_partial(out[qi], lse[qi], o_blk, lse_blk)
            if pending is not None:
                pending.wait()
                block = nxt
        out_t = torch.cat(out, dim=2)
        ctx.group, ctx.scale, ctx.spans = group, scale, spans
        ctx.save_for_backward(q, k, v, out_t, torch.cat(lse, dim=2))
        return out_t.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n, r, hk = group.size, group.rank, k.shape[1]
        g, c = q.shape[1] // hk, q.shape[2] // 2
        dout = accumulated(dout)
        delta = (dout * out).sum(-1)  # rowsum(dO ∘ O)
        qc, doc = q.split(c, dim=2), dout.split(c, dim=2)
        lsec, deltac = lse.split(c, dim=2), delta.split(c, dim=2)
        dq = [accumulated(torch.zeros_like(qc[0])) for _ in range(2)]
        spans = ctx.spans
        block = torch.cat([k, v], dim=1).contiguous()
        dblock = accumulated(torch.zeros_like(block))
        for step in range(n):
            pending, nxt = _pass_on(group, block, step)
            kb, vb = (_expand(t, g).split(c, dim=2) for t in block.split(hk, dim=1))
            dk = [accumulated(torch.zeros_like(kb[0])) for _ in range(2)]
            dv = [accumulated(torch.zeros_like(kb[0])) for _ in range(2)]
            for qi, ki, causal, kj in _block_pairs(n, r, (r - step) % n, spans, c, q.shape[0],
                                                   None):
                p = torch.exp(_scores(qc[qi], kb[ki], causal, scale, _visible(spans, qi, kj, c))
                              - lsec[qi][..., None])
                dv[ki] += torch.matmul(p.transpose(-1, -2), doc[qi])
                ds = p * (torch.matmul(doc[qi], accumulated(vb[ki]).transpose(-1, -2))
                          - deltac[qi][..., None])
                dq[qi] += torch.matmul(ds, accumulated(kb[ki])) * scale
                dk[ki] += torch.matmul(ds.transpose(-1, -2), accumulated(qc[qi])) * scale
            dblock += torch.cat([_fold(torch.cat(dk, dim=2), g), _fold(torch.cat(dv, dim=2), g)],
                                dim=1)
            arrived = torch.empty_like(dblock)  # the next block's accumulator, one rank back
            _ring_step(group, [dblock], [arrived]).wait()
            dblock = arrived
            if pending is not None:
                pending.wait()
                block = nxt
        dk_own, dv_own = dblock.split(hk, dim=1)
        return (torch.cat(dq, dim=2).to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype),
                None, None, None, None)
