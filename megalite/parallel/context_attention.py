"""Causal attention over a sequence sharded across the context-parallel (CP) group.

Each CP rank holds two chunks of every sequence (`context_shard`: chunks r and 2·cp − 1 − r of
2·cp) and computes attention for its own queries against the keys of the whole sequence. Two
ways, `parallel.cp_comm`:

  allgather  K and V are all-gathered over CP (one collective, only the KV heads: cheap under
             grouped-query attention, which the attention kernel runs without repeating K/V)
             and each local query chunk attends to the keys up to its own without a mask: on
             CPU the keys before the chunk and the chunk's own (causally) are two flash calls
             merged by their log-sum-exp (`context_partial`), elsewhere SDPA with
             `causal_lower_right`. In backward the gathered K/V gradients are
             reduce-scattered back to their owners. Llama 3's choice (Dubey et al. 2024,
             §3.3.2).
  ring       K/V blocks travel around the CP ring and the partial results are merged by
             their log-sum-exp (Liu et al. 2023, Ring Attention; `megalite.parallel.
             context_ring`).

Both skip the (query chunk, key chunk) pairs that causality masks entirely: a chunk attends
to the chunks before it in full and to itself causally.

Document masking (`train.attention_mask=document`): `documents` is this rank's
`DocumentSpans` (`megalite.parallel.context_documents`), made on the host from the batch once
per micro-batch, so nothing here reads the device: query t sees key u iff
first[t] <= u <= t. The all-gather path computes each document piece of its chunks (queries
of one chunk and one document) over the keys from its document's start: on CPU the same two
maskless flash calls a piece (dK/dV summed over the pieces in fp32), on CUDA one FlexAttention
call over the gathered keys with the spans' block mask. The ring skips the key chunks that
end before the query chunk's first document in every sequence (the host's `chunk_first`) and
masks the pairs it computes from `first`. No [b, c, S] mask is made. `AttentionWork` counts
the (query, key) scores computed and skipped against the causal plan (per head, summed over
the batch), when given.

Tensors are [batch, heads, local tokens, head dim]; q has `hq` heads, k and v `hk` (hq a
multiple of hk: grouped-query attention, each KV head serving hq / hk query heads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megalite.parallel import context_shard
from megalite.parallel.comm import all_gather, reduce_scatter
from megalite.parallel.context_documents import (
    DocumentSpans,
    chunk_pieces,
    compiled_flex_attention,
)
from megalite.parallel.context_partial import (
    AttentionWork,
    accumulated,
    merge_partial,
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
                 documents: Optional[DocumentSpans] = None,
                 work: Optional[AttentionWork] = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole CP-sharded sequence; with
    `documents` (this rank's `DocumentSpans`, made on the host) within each document only.
    `work`, when given, accumulates the scores computed and skipped."""
    if comm not in CP_COMMS:
        raise ValueError(f"CP attention comm={comm!r}: use one of {', '.join(CP_COMMS)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if q.shape[2] != k.shape[2] or k.shape != v.shape or q.shape[2] % 2:
        raise ValueError(f"CP attention takes this rank's two chunks of every sequence: q {q.shape}, "
                         f"k {k.shape}, v {v.shape} (the same even token count)")
    if documents is not None and tuple(documents.first.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"CP attention's document spans {tuple(documents.first.shape)}: one "
                         f"per local token of every sequence, [{q.shape[0]}, {q.shape[2]}]")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    work = work if work is not None else AttentionWork()
    if group.size == 1 and documents is None:
        n = q.shape[2]
        work.computed += q.shape[0] * n * (n + 1) // 2
        return _sdpa(q, k, v, None, scale, causal=True)
    if comm == "allgather" or group.size == 1:
        return _allgather_attention(q, k, v, group, scale, documents, work)
    return RingAttention.apply(q, k, v, group, scale, documents, work)


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


def _allgather_attention(q, k, v, group: Group, scale: float,
                         documents: Optional[DocumentSpans], work: AttentionWork
                         ) -> torch.Tensor:
    """The all-gather path (module docstring); at cp 1 (documents only) the same kernels over
    the local sequence."""
    hk, c = k.shape[1], q.shape[2] // 2
    kv = torch.cat([k, v], dim=1)
    kv = _GatherSequence.apply(kv, group) if group.size > 1 else kv
    chunks = context_shard.chunk_ids(group.size, group.rank)
    pieces = chunk_pieces(chunks, c) if documents is None else documents.pieces
    _count(pieces, q.shape[0], c, work)
    if q.device.type == "cpu":
        return _PieceAttention.apply(q, kv, hk, pieces, scale)
    if documents is not None:
        positions = context_shard.positions(kv.shape[2], group.size, group.rank, q.device)
        return compiled_flex_attention()(
            q, kv[:, :hk], kv[:, hk:], block_mask=documents.block_mask(positions, kv.shape[2]),
            scale=scale, enable_gqa=q.shape[1] != hk)
    # imported here: torch.nn.attention.bias imports torch._dynamo (a second of CPU), which a
    # command's refusal or --help should not pay for
    from torch.nn.attention.bias import causal_lower_right

    return torch.cat([_sdpa(q[:, :, i * c:(i + 1) * c], kv[:, :hk, :(j + 1) * c],
                            kv[:, hk:, :(j + 1) * c], causal_lower_right(c, (j + 1) * c), scale)
                      for i, j in enumerate(chunks)], dim=2)


def _count(pieces, b: int, c: int, work: AttentionWork) -> None:
    """A piece's queries [g, g + n) of chunk j compute the keys [key start, g + n) (the own
    block's upper triangle included, as causal kernels count a chunk); the causal plan
    computes [0, (j + 1)·c)."""
    for seq, lo, hi, g, first in pieces:
        rows, n = b if seq < 0 else 1, hi - lo
        end = (g // c + 1) * c
        work.computed += rows * n * (g + n - first)
        work.skipped += rows * n * (end - g - n + first)


def _flash_cpu(q, k, v, causal: bool, scale: float):
    """CPU flash attention's (output, log-sum-exp), KV heads shared by their query heads."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)


class _PieceAttention(torch.autograd.Function):
    """Each piece's queries (`context_documents`: [g, g + n) of one sequence, or of all where
    the sequence is -1) over the gathered keys [key start, g + n) without a mask: the keys
    before the piece in full and the piece's own causally (top-left aligned), two flash calls
    merged by their log-sum-exp as in the ring. Saves the gathered K|V, the output and its
    log-sum-exp; backward runs the flash backward of each part against the merged output and
    log-sum-exp (the FlashAttention-2 backward of a key block under the full softmax), the
    pieces' dK/dV summed in the accumulation dtype (fp32 for bf16). CPU only (the CPU flash
    kernel returns the log-sum-exp)."""

    @staticmethod
    def forward(ctx, q, kv, hk: int, pieces, scale: float):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32),
                          device=q.device)
        k, v = kv[:, :hk], kv[:, hk:]
        for seq, lo, hi, g, first in pieces:
            rows = _rows(seq)
            qi, own = q[rows, :, lo:hi], slice(g, g + hi - lo)
            o, m = _flash_cpu(qi, k[rows, :, own], v[rows, :, own], True, scale)
            o = accumulated(o)
            if first < g:
                o_pre, m_pre = _flash_cpu(qi, k[rows, :, first:g], v[rows, :, first:g], False,
                                          scale)
                o, m = merge_partial(o, m, accumulated(o_pre), m_pre)
            out[rows, :, lo:hi] = o.to(q.dtype)
            lse[rows, :, lo:hi] = m
        ctx.hk, ctx.pieces, ctx.scale = hk, pieces, scale
        ctx.save_for_backward(q, kv, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        hk, scale = ctx.hk, ctx.scale
        dq, dkv = torch.empty_like(q), accumulated(torch.zeros_like(kv))
        k, v, dk, dv = kv[:, :hk], kv[:, hk:], dkv[:, :hk], dkv[:, hk:]
        dout = dout.contiguous()
        for seq, lo, hi, g, first in ctx.pieces:
            rows = _rows(seq)
            args = (dout[rows, :, lo:hi], q[rows, :, lo:hi])
            tail = (out[rows, :, lo:hi], lse[rows, :, lo:hi], 0.0)
            for keys, causal in ((slice(g, g + hi - lo), True), (slice(first, g), False)):
                if keys.stop == keys.start:
                    continue
                grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    *args, k[rows, :, keys], v[rows, :, keys], *tail, causal, scale=scale)
                if causal:
                    dq[rows, :, lo:hi] = grads[0]
                else:
                    dq[rows, :, lo:hi] = accumulated(dq[rows, :, lo:hi]) + accumulated(grads[0])
                dk[rows, :, keys] += grads[1]
                dv[rows, :, keys] += grads[2]
        return dq, dkv.to(kv.dtype), None, None, None


def _rows(seq: int) -> slice:
    """A piece's sequences: all (-1) or the one."""
    return slice(None) if seq < 0 else slice(seq, seq + 1)
