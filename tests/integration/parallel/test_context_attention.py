"""Context-parallel attention on real gloo ranks (cp 2 and 4): each rank's outputs and its
dq / dk / dv equal full-sequence causal attention's on the rank's load-balanced chunks, for the
all-gather and the ring paths, with as many KV heads as query heads and with grouped-query
attention (only the KV heads travel); and with a document mask (global document ids carried
by each rank's chunks) equal full-sequence attention within documents, the ring skipping the
chunk pairs the documents mask entirely and the all-gather path the keys before a chunk's
first document (the skipped work counted) — exactly the planner's count of the CP kernels'
work under the mask (`megalite.plan.document_cp`), over all ranks and on the slowest."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megalite.plan.document_cp import DocumentSample, cp_masked_work
from megalite.testing.spawn import run_ranks

pytestmark = pytest.mark.distributed

B, HQ, D = 2, 4, 8


def _documents(world: int) -> torch.Tensor:
    """Two sequences' document ids (chunks of 4 tokens): a short document, one across the
    middle chunks, one to the end."""
    return torch.tensor([[0] * 5 + [1] * (4 * world - 2) + [2] * (4 * world - 3),
                         [0] * 3 + [1] * (4 * world + 1) + [2] * (4 * world - 4)])


def _spans(world: int, rank: int):
    """The rank's `DocumentSpans` of `_documents`, made on the host as DocumentRule.of does."""
    from megalite.data.documents import in_document_positions
    from megalite.parallel.context_documents import DocumentSpans

    ids = _documents(world).numpy()
    eos = np.zeros(ids.shape, dtype=bool)  # each document's last token is its EOS
    eos[:, :-1] = ids[:, 1:] != ids[:, :-1]
    return DocumentSpans.of(np.arange(ids.shape[1]) - in_document_positions(eos), world, rank)


def _host_reads(names, reads):
    """Count the calls that read a tensor's values on the host (a device sync on a GPU)."""
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def counting(name):
        def read(t, *args, **kwargs):
            reads.append(name)
            return saved[name](t, *args, **kwargs)
        return read
    for name in names:
        setattr(torch.Tensor, name, counting(name))
    return saved


HOST_READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


def _errors(rank, world):
    import torch.distributed as dist
    import torch.nn.functional as F

    from megalite.parallel import context_shard
    from megalite.parallel.context_attention import cp_attention
    from megalite.parallel.context_partial import AttentionWork
    from megalite.parallel.group import CommCounter, Group

    group = Group("cp", list(range(world)), rank, dist.group.WORLD, CommCounter())
    seq = 8 * world  # chunks of 4 tokens
    errors, works = {}, {}
    ids = _documents(world)
    same = (ids[:, :, None] == ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    for hk, docs in ((HQ, None), (2, None), (2, ids)):
        torch.manual_seed(hk)  # the same global tensors on every rank
        q, k, v = (torch.randn(B, h, seq, D, dtype=torch.float64) for h in (HQ, hk, hk))
        gout = torch.randn(B, HQ, seq, D, dtype=torch.float64)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        g = HQ // hk
        out = F.scaled_dot_product_attention(
            ref[0], ref[1].repeat_interleave(g, 1), ref[2].repeat_interleave(g, 1),
            is_causal=docs is None, attn_mask=None if docs is None else same[:, None])
        (out * gout).sum().backward()

        def mine(t, dim=2):
            return context_shard.shard(t, world, rank, dim=dim)
        for comm in ("allgather", "ring"):
            ours = [mine(t).clone().requires_grad_() for t in (q, k, v)]
            work, reads = AttentionWork(), []
            saved = _host_reads(HOST_READS, reads)
            try:
                o = cp_attention(*ours, group, comm, work=work,
                                 documents=None if docs is None else _spans(world, rank))
                (o * mine(gout)).sum().backward()
            finally:
                for name, fn in saved.items():
                    setattr(torch.Tensor, name, fn)
            case = (comm, hk, docs is not None)
            errors[(*case, "host reads")] = float(len(reads))
            works[case] = (work.computed, work.skipped)
            for name, a, b in [("out", o, mine(out)), *[(f"d{n}", t.grad, mine(r.grad))
                               for n, t, r in zip("qkv", ours, ref)]]:
                errors[(*case, name)] = ((a - b).abs().max() / b.abs().max()).item()
    return errors, works


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_full_sequence_attention(cp):
    results = run_ranks(_errors, cp, timeout_s=240)
    for errors, _ in results:
        assert len(errors) == 30
        bad = {key: e for key, e in errors.items() if not e < 1e-10}  # host reads: none
        assert not bad, bad
    ids = _documents(cp)
    eos = np.zeros(ids.shape, dtype=bool)  # each document's last token is its EOS
    eos[:, :-1] = (ids[:, 1:] != ids[:, :-1]).numpy()
    for comm in ("allgather", "ring"):  # documents skip work; causal attention skips none
        assert all(works[(comm, 2, False)][1] == 0 for _, works in results)
        ranks = [works[(comm, 2, True)] for _, works in results]
        assert sum(skipped for _, skipped in ranks) > 0, comm
        plan = cp_masked_work(DocumentSample.of(eos), cp, comm, batch=B)
        assert plan.mean == sum(c for c, _ in ranks) / sum(c + s for c, s in ranks), comm
        assert plan.slowest == max(c / (c + s) for c, s in ranks), comm
