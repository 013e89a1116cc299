"""The document mask's CUDA kernels (`train.document_kernel=flex|varlen`) against SDPA with the
boolean mask in fp32: outputs and q/k/v gradients of documents of mixed lengths at several
multiples of FlexAttention's 128-token block, with and without grouped-query heads (flex
compiled twice, and once more for the CP all-gather branch at one rank: the CUDA tests
share one time limit in megalite-bench gpu). Skipped on
machines without a GPU (CI); run on one with
`python -m pytest tests/unit/model/test_cuda_document_attention.py` (megalite-bench gpu's
cuda-tests part does)."""
from __future__ import annotations

import pytest
import torch

from megalite.model.document_attention import AttentionInputs, document_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# per window: the documents' lengths (summing to 640 tokens: five 128-token blocks)
LENGTHS = [[100, 28, 300, 1, 211], [640], [1] * 40 + [600]]


def document_ids() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n))
                        for n in LENGTHS]).cuda()


def attention_and_grads(kernel: str, dtype: torch.dtype, kv_heads: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (len(LENGTHS), 8, 640, 64)
    q, k, v = (torch.randn(shape[0], h, *shape[2:], generator=g, device="cuda")
               .to(dtype).requires_grad_() for h in (8, kv_heads, kv_heads))
    grad = torch.randn(shape, generator=g, device="cuda").to(dtype)
    out = document_attention(q, k, v, AttentionInputs(ids=document_ids(), kernel=kernel), 0.0,
                             "auto")
    return [t.float() for t in (out, *torch.autograd.grad(out, (q, k, v), grad))]


@pytest.mark.parametrize("kernel,dtype,tol,kv_heads", [
    ("flex", torch.float32, 2e-5, 2), ("flex", torch.bfloat16, 3e-2, 8),  # two compilations
    ("varlen", torch.bfloat16, 3e-2, 8), ("varlen", torch.bfloat16, 3e-2, 2)])
def test_cuda_document_kernel_equals_the_boolean_mask(kernel, dtype, tol, kv_heads):
    want = attention_and_grads("sdpa", torch.float32, kv_heads)
    got = attention_and_grads(kernel, dtype, kv_heads)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{kernel} {name}")


def test_cuda_cp_allgather_kernel_equals_the_boolean_mask():
    """The CP all-gather path's CUDA branch (FlexAttention over the keys with the spans' block
    mask, `megalite.parallel.context_documents`) on a group of one rank (its two chunks are
    the whole window), fp32, against SDPA with the boolean mask: outputs and gradients."""
    import numpy as np

    from megalite.parallel.context_attention import cp_attention
    from megalite.parallel.context_documents import DocumentSpans
    from megalite.parallel.group import single_rank_group

    ids = document_ids().cpu().numpy()
    first = np.stack([np.searchsorted(row, row) for row in ids])  # each document's start
    spans = DocumentSpans.of(first, 1, 0).to(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(len(LENGTHS), h, 640, 64, generator=g, device="cuda")
               .requires_grad_() for h in (8, 2, 2))
    grad = torch.randn(len(LENGTHS), 8, 640, 64, generator=g, device="cuda")
    out = cp_attention(q, k, v, single_rank_group("cp"), documents=spans)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want_out = document_attention(*ref, AttentionInputs(ids=document_ids(), kernel="sdpa"),
                                  0.0, "auto")
    want = [want_out, *torch.autograd.grad(want_out, ref, grad)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=f"cp allgather {name}")
