"""What the CP kernels take under the document mask (`megalite.parallel.context_documents`),
on CPU in one process: FlexAttention's block masks (the CP all-gather path's on CUDA, and the
single-rank `AttentionInputs.block_mask`) forward against SDPA with the boolean mask, where
FlexAttention runs on CPU (eagerly, forward only); the block mask's bytes as the plan counts
them; and the CPU all-gather kernel's dK/dV summed over its pieces in fp32. (cp = serial on
gloo ranks, the pieces' work and the host reads: tests/integration/parallel/
test_context_attention.py.)"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from megalite.data.documents import DocumentRule
from megalite.model.document_attention import AttentionInputs
from megalite.parallel import context_shard
from megalite.parallel.context_attention import cp_attention
from megalite.parallel.context_documents import DocumentSpans, block_mask_bytes
from megalite.parallel.group import single_rank_group

EOS, CP, S, B, HQ, HK, D = 0, 4, 64, 2, 4, 2, 8


def _windows() -> np.ndarray:
    """Two windows of S tokens, documents of several lengths ended by EOS."""
    x = np.random.default_rng(0).integers(1, 50, size=(B, S))
    for w, ends in enumerate(([4, 5, 20, 41, 50], [13, 14, 15, 33, 62])):
        x[w, ends] = EOS
    return x


def _boolean_mask(ids: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """[b, 1, len(q_pos), s]: query at q_pos sees key u <= it in its own document."""
    u = torch.arange(ids.shape[1])
    return ((u[None, :] <= q_pos[:, None]) & (ids[:, q_pos, None] == ids[:, None, :]))[:, None]


def test_the_cp_block_mask_forward_equals_the_boolean_mask_on_cpu():
    window = _windows()
    ids = DocumentRule(EOS).of(window).ids
    torch.manual_seed(0)
    k, v = (torch.randn(B, HK, S, D) for _ in range(2))
    for rank in range(CP):
        spans = DocumentRule(EOS).of(window, (CP, rank)).spans
        positions = context_shard.positions(S, CP, rank)
        q = torch.randn(B, HQ, S // CP, D)
        mask = spans.block_mask(positions, S, block=4)  # 8 tokens a chunk: 2 blocks
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=_boolean_mask(ids, positions),
                                              enable_gqa=True)
        assert torch.allclose(out, want, atol=1e-6), rank
        visited = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
        assert visited < B * (S // CP // 4) * (S // 4) // 2  # most blocks skipped
        tensors = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                   mask.full_kv_indices, mask.q_num_blocks, mask.q_indices,
                   mask.full_q_num_blocks, mask.full_q_indices)
        assert sum(t.nbytes for t in tensors) == block_mask_bytes(B, S // CP, S, block=4)


def test_the_single_rank_block_mask_forward_equals_the_boolean_mask_on_cpu():
    inputs = AttentionInputs.of(DocumentRule(EOS).of(_windows()), "flex")
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, h, S, D) for h in (HQ, HK, HK))
    out = flex_attention(q, k, v, block_mask=inputs.block_mask(), enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=inputs.sdpa_mask(), enable_gqa=True)
    assert torch.allclose(out, want, atol=1e-6)


def test_the_cpu_kernel_sums_its_pieces_dk_dv_in_fp32():
    """One document of 64 tokens cut into 16 pieces: key 0 takes a gradient from each. The
    kernel's dK/dV is the fp32 sum of every piece's own (each exact in bf16: a piece's keys
    are its own or before it, one flash call each), rounded to bf16 once; bf16 sums
    (rounded at every piece) differ."""
    first = torch.zeros(1, S, dtype=torch.int64)
    spans = DocumentSpans(first, tuple((0, p, p + 4, p, 0) for p in range(0, S, 4)), (0, 0))
    group = single_rank_group("cp")
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, h, S, D, dtype=torch.bfloat16) for h in (HQ, HK, HK))
    gout = torch.randn(1, HQ, S, D, dtype=torch.bfloat16)

    def grads(pieces):
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        out = cp_attention(*ours, group, documents=replace(spans, pieces=pieces))
        lo, hi = pieces[0][1], pieces[-1][2]
        (out[:, :, lo:hi].float() * gout[:, :, lo:hi].float()).sum().backward()
        return ours[1].grad, ours[2].grad

    dk, dv = grads(spans.pieces)
    each = [grads((piece,)) for piece in spans.pieces]
    for got, i in ((dk, 0), (dv, 1)):
        fp32 = sum(g[i].float() for g in each).to(torch.bfloat16)
        bf16 = each[0][i]
        for g in each[1:]:
            bf16 = bf16 + g[i]
        assert torch.equal(got, fp32)
        assert not torch.equal(got, bf16)
