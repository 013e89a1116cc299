"""Which kernel computes attention within documents (`train.document_kernel`, with
`train.attention_mask=document`; `megalite.model.document_attention` runs them):

  flex     FlexAttention (Dong et al. 2024, compiled) with a block-sparse mask: CUDA only,
           no attention dropout; the masked 128x128 blocks are skipped
  varlen   `torch.nn.attention.varlen.varlen_attn`: FlashAttention-2's variable-length
           kernel (Dao 2023) over the window's documents as separate sequences (torchtitan's
           attn_type=varlen, Megatron's packed THD); CUDA only, bf16/fp16, an Ampere or newer
           GPU, no attention dropout
  sdpa     SDPA with a dense boolean mask (s² bools a sequence), train.attention's kernel:
           every device, dropout allowed
  auto     flex on CUDA without attention dropout with train.attention=auto, else sdpa

Under cp > 1 the CP kernels carry the documents themselves (`megalite.parallel.
context_attention`): only auto runs there.

Which of flex and varlen is faster depends on the GPU and the documents' lengths;
`megalite-bench gpu` (its document-mask part) and `megalite-plan --calibrate` time both.
"""
from __future__ import annotations

from typing import List, Optional

from megalite.config.errors import fail

DOCUMENT_KERNELS = ("auto", "flex", "varlen", "sdpa")
CUDA_KERNELS = ("flex", "varlen")  # need a GPU and no attention dropout
MEASURED_KERNELS = ("flex", "varlen", "sdpa")  # what auto resolves to: the calibrated kernels


def resolved_document_kernel(kernel: str, device_type: str, attn_pdrop: float,
                             attention: str) -> str:
    """The kernel `kernel` (train.document_kernel) runs on `device_type` with attention dropout
    `attn_pdrop` and SDPA kernel `attention` (train.attention): flex, varlen or sdpa."""
    if kernel != "auto":
        return kernel
    return "flex" if device_type == "cuda" and attn_pdrop == 0 and attention == "auto" \
        else "sdpa"


def check_document_kernel(kernel: str, attention_mask: str, attention: str) -> None:
    """train.document_kernel on its own section's values (before any process group)."""
    if kernel not in DOCUMENT_KERNELS:
        fail("train.document_kernel", kernel, f"use one of {', '.join(DOCUMENT_KERNELS)}")
    if kernel != "auto" and attention_mask != "document":
        fail("train.document_kernel", kernel, "chooses the kernel of the document mask only; "
              "set train.attention_mask=document, or leave it at auto")
    if kernel in CUDA_KERNELS and attention != "auto":
        fail("train.attention", attention, f"names an SDPA kernel, which "
              f"train.document_kernel={kernel} does not run; leave train.attention=auto, or "
              "use train.document_kernel=sdpa")


def check_document_kernel_on_device(kernel: str, device_type: str, precision: str,
                                    attn_pdrop: float, cp: int, head_dim: int,
                                    bf16_gpu: Optional[bool]) -> None:
    """train.document_kernel against the device, precision, dropout, head size and CP of the
    run (`bf16_gpu`: whether the GPU is Ampere or newer; None: unknown, taken as yes)."""
    if kernel != "auto" and cp > 1:
        fail("train.document_kernel", kernel, f"is not supported with cp={cp} (context "
              "parallelism): the CP kernels mask the documents themselves; use auto")
    if kernel not in CUDA_KERNELS:
        return
    if device_type != "cuda":
        fail("train.document_kernel", kernel, "runs on CUDA GPUs only; on CPU use auto or sdpa "
              "(SDPA with a boolean mask)")
    if attn_pdrop > 0:
        fail("train.document_kernel", kernel, f"has no attention dropout (model.attn_pdrop="
              f"{attn_pdrop}); use sdpa, or model.attn_pdrop=0")
    if kernel == "varlen":
        _check_varlen(precision, head_dim, bf16_gpu)


def _check_varlen(precision: str, head_dim: int, bf16_gpu: Optional[bool]) -> None:
    """FlashAttention-2's limits (Dao 2023): fp16/bf16, sm80 or newer, head size a multiple of
    8 up to 256 (varlen_attn does not pad as SDPA does)."""
    why = "is FlashAttention-2's variable-length kernel, which"
    if bf16_gpu is False:
        fail("train.document_kernel", "varlen", f"{why} needs an Ampere or newer GPU (compute "
              "capability 8.0); use flex or sdpa")
    if precision == "fp32":
        fail("train.document_kernel", "varlen", f"{why} computes in bf16/fp16 only "
              "(precision=fp32); use flex or sdpa, or precision=bf16")
    if head_dim % 8 or head_dim > 256:
        fail("train.document_kernel", "varlen", f"{why} takes head sizes that are multiples of "
              f"8 up to 256 (model.n_embd / model.n_head = {head_dim}); use flex or sdpa")


def runnable_document_kernels(device_type: str, attn_pdrop: float, precision: str,
                              bf16_gpu: Optional[bool]) -> List[str]:
    """The kernels a run with these settings may name (at a head size varlen takes): the
    rules of `check_document_kernel_on_device`, for the calibration to time each."""
    if device_type != "cuda" or attn_pdrop > 0:
        return ["sdpa"]
    half = precision in ("bf16", "fp16") and bf16_gpu is not False
    return ["flex", "varlen", "sdpa"] if half else ["flex", "sdpa"]
