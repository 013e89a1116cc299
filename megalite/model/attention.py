"""Which fused kernel computes causal attention, softmax(QKᵀ/√d + mask)·V.

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
from typing import Callable, Dict

from torch.nn.attention import SDPBackend, sdpa_kernel

from megalite.config.schema import ATTENTION_CHOICES

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
