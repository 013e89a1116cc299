"""The chunked cross-entropy (megalite/parallel/cross_entropy.py) at tp = 1: equal to the fp32
`F.cross_entropy` it replaced, in every dtype and chunking, and its peak bytes: the logits'
gradient plus one fp32 chunk, where the old path held three fp32 [N, V] buffers. Across TP
ranks: tests/integration/parallel/test_tensor_parallel.py; in the models: test_model.py (transformers
parity), the serial-parity tests of tests/integration."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.parallel.cross_entropy import chunk_rows, cross_entropy
from megalite.parallel.group import single_rank_group
from megalite.plan.dims import loss_bytes
from megalite_bench.loss import fp32_loss_bytes, measure

VOCAB, PADDED = 2000, 2048


def _logits(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, PADDED, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [7, 64, 0])  # 0: the default, one chunk here
def test_chunked_loss_equals_the_fp32_cross_entropy(dtype, rows):
    n = 64
    logits = _logits(n, dtype)
    target = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(1))
    upstream = torch.rand(n, generator=torch.Generator().manual_seed(2))
    ref_in, ours_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in[:, :VOCAB].float(), target, reduction="none")
    (ref * upstream).sum().backward()
    ours = cross_entropy(ours_in, target, single_rank_group("tp"), 0, VOCAB, rows)
    (ours * upstream).sum().backward()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert ours_in.grad.dtype == dtype and not ours_in.grad[:, VOCAB:].any()
    if dtype == torch.float32:  # softmax as exp(z - (M + lse)): a few fp32 units apart
        torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-9)
    else:  # rounded once from fp32, as the cast back did: exactly our fp32 gradient rounded,
        #    and at most one unit of the dtype from the reference's: the two fp32 values are a
        #    few fp32 units apart (whose exp kernel, per CPU capability), so they may round to
        #    neighbours — one subnormal step (finfo.smallest_normal · eps, 2^-24 in fp16) below
        #    the normal range, where eps · |x| is smaller than a step
        wide = logits.float().requires_grad_()
        (cross_entropy(wide, target, single_rank_group("tp"), 0, VOCAB, rows)
         * upstream).sum().backward()
        assert torch.equal(ours_in.grad, wide.grad.to(dtype))
        info = torch.finfo(dtype)
        unit = (info.eps * ref_in.grad.float().abs()).clamp(min=info.smallest_normal * info.eps)
        assert ((ours_in.grad.float() - ref_in.grad.float()).abs() <= unit).all()


def test_chunked_loss_peak_is_its_gradient_and_one_chunk():
    """Forward + backward of 4,096 bf16 logits rows: the loss allocates the gradient of the
    logits (2·N·V) and one fp32 chunk of 64 rows, no more (within 1%, the plan's
    `loss_bytes`); the old fp32 path held three fp32 [N, V] buffers (6x the logits)."""
    n, rows = 4096, 64
    logits = _logits(n, torch.bfloat16)
    target = torch.randint(0, VOCAB, (n,))
    group = single_rank_group("tp")
    new = measure(lambda z, t: cross_entropy(z, t, group, 0, VOCAB, rows).mean(), logits,
                  target)
    grad, chunk = 2 * n * PADDED, 4 * rows * PADDED
    assert grad + chunk <= new["peak"] <= 1.01 * (grad + chunk)
    assert new["saved"] < 32 * n  # beyond the logits: a few numbers per token
    old = measure(lambda z, t: F.cross_entropy(z[:, :VOCAB].float(), t), logits, target)
    assert old["peak"] >= fp32_loss_bytes(n, VOCAB)["peak"] == 3 * 4 * n * VOCAB
    planned = loss_bytes(n, PADDED, 2, tp=1)  # with the default chunk: one of 4,096 rows
    assert chunk_rows(PADDED) >= n and planned["backward"] == pytest.approx(
        2 * n * PADDED + 4 * n * PADDED, rel=0.01)
