"""The plan's CP terms against `megalite.parallel.context_attention.cp_attention` on real gloo
ranks (cp 4 and 2, allgather and ring, as many KV heads as query heads and grouped-query
attention, bf16; the grouped-query cases within documents): its traffic
(`megalite.plan.cp_terms.wire_bytes`) equals, to the byte, what one layer's forward and
backward record in the ranks' `CommCounter` (the ring's gradient accumulators travel in fp32;
under recompute a checkpointed layer re-runs its forward's transfers; no document ids
travel), and what it saves for backward beyond its inputs and output equals
`cp_terms.saved_bytes` + the log-sum-exp the family's formula counts (within documents too:
no mask is saved)."""
from __future__ import annotations

import pytest

from megalite.testing.spawn import run_ranks

pytestmark = pytest.mark.distributed

B, HQ, D, CHUNK = 2, 4, 8, 2  # CHUNK: tokens of each of the 2·cp chunks


def _spans(seq: int, cp: int, index: int):
    """The documents of two windows (EOS = 0 at their 2nd and middle tokens), this rank's."""
    import numpy as np

    from megalite.data.documents import DocumentRule

    window = np.ones((B, seq), dtype=np.int64)
    window[:, [1, seq // 2]] = 0
    return DocumentRule(0).of(window, (cp, index)).spans


def _counted_and_planned(rank, world):
    from dataclasses import replace

    import torch
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from megalite.config.layout import Layout
    from megalite.config.schema import load_config
    from megalite.parallel.context_attention import cp_attention
    from megalite.parallel.group import CommCounter, Group
    from megalite.plan.cp_terms import saved_bytes, wire_bytes

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    groups = {world: (list(range(world)), rank, dist.group.WORLD),
              2: ([2 * (rank // 2), 2 * (rank // 2) + 1], rank % 2, pairs[rank // 2])}
    out = {}
    for cp, (ranks, index, pg) in groups.items():
        seq = 2 * cp * CHUNK
        for hk in (HQ, 2):
            for comm in ("allgather", "ring"):
                for recompute in (False, True):
                    counter = CommCounter()
                    group = Group("cp", ranks, index, pg, counter)
                    torch.manual_seed(hk)
                    q, k, v = (torch.randn(B, h, seq // cp, D, dtype=torch.bfloat16,
                                           requires_grad=True) for h in (HQ, hk, hk))

                    spans = _spans(seq, cp, index) if hk == 2 else None

                    def attention(q, k, v, group=group, comm=comm, spans=spans):
                        return cp_attention(q, k, v, group, comm, documents=spans)
                    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
                    saved = {}

                    def pack(t, saved=saved, inputs=inputs):
                        if t.untyped_storage().data_ptr() not in inputs:
                            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                        return t
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        o = checkpoint(attention, q, k, v, use_reentrant=False) \
                            if recompute else attention(q, k, v)
                    saved.pop(o.untyped_storage().data_ptr(), None)
                    o.float().sum().backward()
                    counted = sum(s["wire_bytes"] for key, s in counter.snapshot().items()
                                  if key.startswith("cp/"))
                    cfg = load_config(["model=llama-tiny", f"train.seq_len={seq}",
                                       f"train.micro_batch_size={B}", f"cp={cp}",
                                       f"parallel.cp_comm={comm}"])
                    cfg = replace(cfg, model=replace(cfg.model, n_head=HQ, n_kv_head=hk,
                                                     n_embd=HQ * D))
                    layout = Layout(cp_size=cp, precision="bf16")
                    planned = wire_bytes(cfg, layout, 2, 1, int(recompute))
                    out[(cp, hk, comm, recompute)] = (counted, planned)
                    if not recompute:
                        local = seq // cp
                        out[(cp, hk, comm, "saved")] = (
                            sum(saved.values()), saved_bytes(cfg, layout, 2) + 4 * B * HQ * local)
    return out


def test_cp_wire_and_saved_bytes_equal_the_kernels():
    for rank_result in run_ranks(_counted_and_planned, 4, timeout_s=300):
        assert len(rank_result) == 24
        wrong = {case: pair for case, pair in rank_result.items() if pair[0] != pair[1]}
        assert not wrong, wrong
        assert all(counted > 0 for counted, _ in rank_result.values())
