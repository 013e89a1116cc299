"""Context-parallel attention on real gloo ranks (cp 2 and 4): each rank's outputs and its
dq / dk / dv equal full-sequence causal attention's on the rank's load-balanced chunks, for the
all-gather and the ring paths, with as many KV heads as query heads and with grouped-query
attention (only the KV heads travel)."""
from __future__ import annotations

import pytest
import torch

from megalite.testing.spawn import run_ranks

pytestmark = pytest.mark.distributed

B, HQ, D = 2, 4, 8


def _errors(rank, world):
    import torch.distributed as dist
    import torch.nn.functional as F

    from megalite.parallel import context_shard
    from megalite.parallel.context_attention import cp_attention
    from megalite.parallel.group import CommCounter, Group

    group = Group("cp", list(range(world)), rank, dist.group.WORLD, CommCounter())
    seq = 4 * world  # chunks of 2 tokens
    errors = {}
    for hk in (HQ, 2):
        torch.manual_seed(hk)  # the same global tensors on every rank
        q, k, v = (torch.randn(B, h, seq, D, dtype=torch.float64) for h in (HQ, hk, hk))
        gout = torch.randn(B, HQ, seq, D, dtype=torch.float64)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        g = HQ // hk
        out = F.scaled_dot_product_attention(ref[0], ref[1].repeat_interleave(g, 1),
                                             ref[2].repeat_interleave(g, 1), is_causal=True)
        (out * gout).sum().backward()

        def mine(t):
            return context_shard.shard(t, world, rank, dim=2)
        for comm in ("allgather", "ring"):
            ours = [mine(t).clone().requires_grad_() for t in (q, k, v)]
            o = cp_attention(*ours, group, comm)
            (o * mine(gout)).sum().backward()
            for name, a, b in [("out", o, mine(out)), *[(f"d{n}", t.grad, mine(r.grad))
                               for n, t, r in zip("qkv", ours, ref)]]:
                errors[(comm, hk, name)] = ((a - b).abs().max() / b.abs().max()).item()
    return errors


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_full_sequence_attention(cp):
    for errors in run_ranks(_errors, cp, timeout_s=240):
        assert len(errors) == 16
        bad = {key: e for key, e in errors.items() if not e < 1e-10}
        assert not bad, bad
