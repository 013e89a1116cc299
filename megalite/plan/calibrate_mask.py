"""The document-masked attention kernel's rate, measured by `--calibrate` beside the causal
block (`megalite.plan.calibrate_block`) for the time model's masked attention
(`megalite.plan.document_terms`).

A block of the model's family is timed forward + backward twice at the calibrated shape
(s = train.seq_len, b = train.micro_batch_size): causal (t_c), and with the document mask of
documents of L = s // CALIBRATION_DOCUMENTS tokens each (t_m), the kernel the run would use
(`masked_kernel`: FlexAttention on CUDA without attention dropout, else SDPA with a dense
mask). The rest of the block being the same, the difference is the attention's:

    t_m − t_c = A · (w · ratio − 1) / R      A = 3 · 4·h·s · s·b  (the block pass's dense
                                                causal attention FLOPs), R the matmul rate,
                                                w the kernel's work at L (block fraction for
                                                flex, 1 for sdpa)

so  ratio = (1 + R · (t_m − t_c) / A) / w   (at least 0): the masked kernel's time per unit of
its work over the dense causal attention at R. The time model charges A · w' · ratio / R for a
run whose corpus gives work w'.
"""
from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from megalite.config.layout import PRECISION_DTYPES
from megalite.config.schema import ModelConfig
from megalite.model.document_attention import AttentionInputs
from megalite.plan.calibrate_block import time_block
from megalite.plan.document_terms import work_of

CALIBRATION_DOCUMENTS = 4  # documents a window at the calibration's document length


def document_ids(seq_len: int, batch: int, document_tokens: int) -> torch.Tensor:
    """[batch, seq_len] ids of documents of `document_tokens` tokens from the window's start."""
    return (torch.arange(seq_len) // document_tokens).expand(batch, seq_len).contiguous()


def measure_mask_ratio(model: ModelConfig, seq_len: int, micro_batch: int, dtype: str,
                       rate_tflops: float, device: torch.device, kernel: str,
                       compile: bool = False) -> Dict[str, object]:
    """The profile's `block_overhead.document_mask` entry (module docstring)."""
    length = max(1, seq_len // CALIBRATION_DOCUMENTS)
    eos = (np.arange(seq_len) % length == length - 1)[None, :]
    measured = work_of(eos, f"documents of {length} tokens")
    w = measured.blocks if kernel == "flex" else 1.0
    attn = AttentionInputs(ids=document_ids(seq_len, micro_batch, length).to(device))
    torch_dtype = PRECISION_DTYPES[dtype]
    causal = time_block(model, seq_len, micro_batch, torch_dtype, device, compile=compile)
    masked = time_block(model, seq_len, micro_batch, torch_dtype, device, compile=compile,
                        attn=attn)
    flops = 3 * 4 * model.n_embd * seq_len * seq_len * micro_batch
    ratio = max(0.0, (1 + rate_tflops * 1e12 * (masked - causal) / flops) / w)
    return {"kernel": kernel, "document_tokens": length, "work": w,
            "pairs": measured.pairs, "causal_s": causal, "masked_s": masked, "ratio": ratio}
