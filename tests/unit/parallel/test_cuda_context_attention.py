"""The CP chunk kernels' CUDA branch (megalite/parallel/context_attention.py, the all-gather
path): on a GPU each of one rank's two query chunks attends to the gathered keys up to its own
chunk by SDPA with `causal_lower_right` (CPU runs two flash calls merged instead). Checked in one
process against full causal attention: rank r of cp ranks computes its chunks with the
all-gather and its reduce-scatter answered as the other ranks would answer them (the full
sequence's K|V; this rank's own share of the K/V gradient, which is all that reaches it from its
own queries), outputs and q/k/v gradients against SDPA over the whole sequence restricted to
rank r's queries. Skipped without a GPU; `megalite-bench gpu`'s cuda-tests part runs it.
Written against CUDA semantics; not yet run on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.parallel import context_attention, context_shard
from megalite.parallel.context_attention import cp_attention
from megalite.parallel.group import CommCounter, Group

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

B, HQ, S, D = 2, 4, 256, 32


@pytest.mark.parametrize("cp, rank", [(2, 0), (2, 1), (4, 1), (4, 3)])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_one_ranks_chunks_by_lower_right_sdpa_equal_full_attention(cp, rank, kv_heads, dtype,
                                                                   tol, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(cp * 10 + rank)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", generator=g).to(dtype)
               for h in (HQ, kv_heads, kv_heads))
    full_kv = torch.cat([k, v], dim=1)
    group = Group(name="cp", ranks=list(range(cp)), rank=rank, pg=None, counter=CommCounter())

    def gathered(out, local, group, async_op=False):  # every rank's K|V, in rank order
        out.copy_(context_shard.reshard(full_kv.permute(2, 0, 1, 3), cp, dim=0))
        return out

    def scattered(out, full, group, op=None, async_op=False):  # this rank's chunk
        out.copy_(full.chunk(cp, dim=0)[group.rank])
        return out

    lower_right = []

    def causal_lower_right(*size):
        lower_right.append(size)
        return real_lower_right(*size)
    import torch.nn.attention.bias as attention_bias  # context_attention imports it when used

    real_lower_right = attention_bias.causal_lower_right
    monkeypatch.setattr(context_attention, "all_gather", gathered)
    monkeypatch.setattr(context_attention, "reduce_scatter", scattered)
    monkeypatch.setattr(attention_bias, "causal_lower_right", causal_lower_right)

    local = [context_shard.shard(t, cp, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
    out = cp_attention(*local, group, "allgather")
    c = S // (2 * cp)
    assert lower_right == [(c, (j + 1) * c) for j in context_shard.chunk_ids(cp, rank)]
    dout = torch.randn(out.shape, device="cuda", generator=g).to(dtype)
    out.backward(dout)

    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    full = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=kv_heads != HQ)
    mine = context_shard.shard(full, cp, rank, dim=2)
    mine.backward(dout.float())
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), mine, rtol=tol, atol=tol)
    for ours, theirs in zip(local, ref):
        torch.testing.assert_close(ours.grad.float(),
                                   context_shard.shard(theirs.grad, cp, rank, dim=2),
                                   rtol=tol, atol=tol)
