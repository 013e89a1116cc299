"""What the context-parallel attention kernels share (`megalite.parallel.context_attention`'s
all-gather path and `megalite.parallel.context_ring`): the work counters and the merge of
partial attention results by their log-sum-exp (the online softmax of Milakov & Gimelshein
2018, as in FlashAttention and Ring Attention): for partial outputs
(o₁, l₁), (o₂, l₂) over disjoint key sets,

    l = log(e^l₁ + e^l₂),   o = o₁·e^(l₁ − l) + o₂·e^(l₂ − l).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionWork:
    """(query, key) scores per head, summed over the batch: `computed` by the kernel,
    `skipped` of those the causal plan computes because the document mask empties them."""

    computed: int = 0
    skipped: int = 0


def accumulated(x: torch.Tensor) -> torch.Tensor:
    """`x` in the accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp with its -inf rows (no key of the block visible) as 0, to subtract:
    their probabilities come out 0 instead of NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def merge_partial(o, lse, o_blk, lse_blk):
    """(o, lse) of two partial results over disjoint key sets merged (module docstring)."""
    new = torch.logaddexp(lse, lse_blk)
    at = finite_lse(new)  # a row with no visible key so far stays (0, -inf)
    return o * torch.exp(lse - at)[..., None] + o_blk * torch.exp(lse_blk - at)[..., None], new
