"""The document-masked attention kernel's rate, measured by `--calibrate` beside the block
(`megalite.plan.calibrate_block`) for the time model's masked attention
(`megalite.plan.document_terms`).

The model's attention kernels are timed alone, forward + backward, at the calibrated shape
(s = train.seq_len, b = train.micro_batch_size, the model's heads; its attention dropout):
causal (`megalite.model.attention.causal_attention`, t_c) and with the document mask of
documents of L = s // CALIBRATION_DOCUMENTS tokens each
(`megalite.model.document_attention.document_attention`, t_m) by every kernel that can run
the model here (`kernels_here`: on CUDA without attention dropout FlexAttention, the
variable-length kernel in bf16/fp16 on an Ampere or newer GPU, and SDPA with a dense mask;
elsewhere SDPA). Alone, not inside a block: the difference is a few percent of a block's
time, below a block timing's noise on a shared CPU. With

    t_m − t_c = A · (w · ratio − 1) / R      A = 3 · 4·h·s · s·b  (forward + backward dense
                                                causal attention FLOPs), R the matmul rate,
                                                w the kernel's work at L (block fraction for
                                                flex, pair fraction for varlen, 1 for sdpa:
                                                `megalite.plan.document_terms.kernel_work`)

ratio = (1 + R · (t_m − t_c) / A) / w   (at least 0): the masked kernel's time per unit of its
work over the dense causal attention at R (the causal kernel's own time beyond its FLOPs is
the block's `non_matmul`). The time model charges A · w' · ratio / R for a run whose corpus
gives work w'. Of two kernels the faster for a corpus is the one of smaller w'·ratio
(`megalite-plan` shows each measured kernel's time for the run's corpus).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

from megalite.config.document_kernel import runnable_document_kernels
from megalite.config.layout import PRECISION_DTYPES
from megalite.config.schema import ModelConfig
from megalite.model.attention import causal_attention
from megalite.model.document_attention import AttentionInputs, document_attention
from megalite.plan.calibrate_block import best_time
from megalite.plan.document_terms import kernel_work, work_of

CALIBRATION_DOCUMENTS = 4  # documents a window at the calibration's document length


def document_ids(seq_len: int, batch: int, document_tokens: int) -> torch.Tensor:
    """[batch, seq_len] ids of documents of `document_tokens` tokens from the window's start."""
    return (torch.arange(seq_len) // document_tokens).expand(batch, seq_len).contiguous()


def time_attention(model: ModelConfig, seq_len: int, batch: int, dtype: torch.dtype,
                   device: torch.device, inputs: Optional[AttentionInputs],
                   budget_s: float = 0.5, max_timings: int = 8) -> float:
    """Best seconds of the model's attention forward + backward (causal where `inputs` is
    None, else within its documents) over up to `max_timings` timings within about
    `budget_s`, after a warm-up (FlexAttention compiles there)."""
    g = torch.Generator(device=device).manual_seed(0)
    head_dim = model.head_size

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(batch, heads, seq_len, head_dim, generator=g, device=device,
                           dtype=dtype, requires_grad=True)
    q, k, v = tensor(model.n_head), tensor(model.kv_heads), tensor(model.kv_heads)
    grad = torch.randn(q.shape, generator=g, device=device, dtype=dtype)
    p = model.attn_pdrop

    def one() -> None:
        out = causal_attention(q, k, v, p) if inputs is None else \
            document_attention(q, k, v, inputs, p, "auto")  # the kernel is inputs.kernel
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return best_time(one, budget_s, max_timings)


def kernels_here(device: torch.device, attn_pdrop: float, dtype: str,
                 capability: Optional[tuple]) -> List[str]:
    """The document-mask kernels a run of a model with `attn_pdrop` can use on `device` in
    `dtype` (`megalite.config.document_kernel`); `capability` the GPU's (major, minor)."""
    ampere = None if capability is None else tuple(capability) >= (8, 0)
    return runnable_document_kernels(device.type, attn_pdrop, dtype, ampere)


def measure_mask_ratios(model: ModelConfig, seq_len: int, micro_batch: int, dtype: str,
                        rate_tflops: float, device: torch.device, kernels: List[str]
                        ) -> List[Dict[str, object]]:
    """The profile's `document_mask` entries (module docstring), one per kernel of
    `kernels`, each against one timing of the causal kernel."""
    length = max(1, seq_len // CALIBRATION_DOCUMENTS)
    eos = (np.arange(seq_len) % length == length - 1)[None, :]
    measured = work_of(eos, f"documents of {length} tokens")
    torch_dtype = PRECISION_DTYPES[dtype]
    ids = document_ids(seq_len, micro_batch, length).to(device)
    causal = time_attention(model, seq_len, micro_batch, torch_dtype, device, None)
    flops = 3 * 4 * model.n_head * model.head_size * seq_len * seq_len * micro_batch
    out = []
    for kernel in kernels:
        w = kernel_work(measured, kernel)
        masked = time_attention(model, seq_len, micro_batch, torch_dtype, device,
                                AttentionInputs(ids=ids, kernel=kernel))
        ratio = max(0.0, (1 + rate_tflops * 1e12 * (masked - causal) / flops) / w)
        out.append({"kernel": kernel, "document_tokens": length, "work": w,
                    "pairs": measured.pairs, "causal_s": causal, "masked_s": masked,
                    "ratio": ratio})
    return out
