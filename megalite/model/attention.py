"""Causal attention, softmax(QKᵀ/√d + mask)·V, for every family (`causal_attention`:
grouped-query heads, context parallelism), and which fused kernel computes it.

`F.scaled_dot_product_attention` dispatches among four kernels: FlashAttention-2 (Dao 2023),
cuDNN's fused attention (NVIDIA's flash-style kernels, with Hopper's own instructions), the
memory-efficient kernel (Rabe & Staats 2021, xFormers) and the math reference. `train.attention`
picks, as Megatron's `--attention-backend` does:

  auto                            PyTorch's own order (flash first for bf16 on CUDA)
  flash | cudnn | efficient | math  that kernel only: PyTorch raises if it cannot run the inputs

`python scripts/bench.py attention` times each kernel on a model's shapes; `scripts/bench.py
train --attention flash cudnn` compares them in whole training steps.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megalite.config.train_section import ATTENTION_CHOICES
from megalite.parallel.context_attention import ContextParallel, cp_attention

# SDPA's enable_gqa (grouped-query attention without repeating k and v) came with torch 2.5
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

BACKENDS: Dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def kernel_region(choice: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context that restricts SDPA to `choice`'s kernel (traceable by
    torch.compile, which bakes the choice into the compiled graph)."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention kernel {choice!r}: use one of {', '.join(ATTENTION_CHOICES)}")
    if choice == "auto":
        return contextlib.nullcontext
    backend = BACKENDS[choice]
    return lambda: sdpa_kernel(backend)


def token_positions(local_len: int, cp: Optional[ContextParallel], device) -> torch.Tensor:
    """The global positions of this rank's `local_len` tokens of a sequence (what learned
    position embeddings and RoPE index): 0..s-1, or this rank's CP chunks' positions."""
    if cp is None or cp.group.size == 1:
        return torch.arange(local_len, device=device)
    return cp.positions(local_len, device)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float = 0.0,
                     cp: Optional[ContextParallel] = None) -> torch.Tensor:
    """Causal attention of q [b, a, s, d] over k, v [b, g, s, d], query head i reading KV head
    i // (a / g) (transformers' repeat_kv; g = a without grouped-query attention). With a CP
    group of more than one rank, `s` is this rank's two chunks of every sequence and the keys
    are the whole sequence's (`megalite.parallel.context_attention`: only the KV heads
    travel; attention dropout is refused with cp > 1 before launch)."""
    if cp is not None and cp.group.size > 1:
        return cp_attention(q, k, v, cp.group, cp.comm)
    return grouped_attention(q, k, v, p)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float
                      ) -> torch.Tensor:
    """Causal SDPA of q [b, a, s, d] over k, v [b, g, s, d]: SDPA's own grouped-query
    attention (torch >= 2.5), else k and v repeated."""
    if q.shape[1] == k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    if SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                          v.repeat_interleave(group, dim=1), dropout_p=p,
                                          is_causal=True)
