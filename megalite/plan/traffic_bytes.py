"""Bytes of device-memory traffic the time model charges at HBM bandwidth for the work that
is not matmuls: the loss per logit element by implementation, a dropout site per element, the
optimizer step per parameter (`megalite.plan.time_model`'s head_loss, non_matmul and optimizer
terms take them from here)."""
from __future__ import annotations

from typing import Dict, Tuple

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.parallel.param_spec import padded_vocab_size

# Bytes of device-memory traffic per logit element of the loss, (forward, backward), by
# implementation: the one place the `head_loss` term takes them from. "chunked" is the loss
# megalite computes now (`megalite.parallel.cross_entropy`, at every tp, compiled or not); the
# others model `GPT2.loss` as it was when the H100 figures (tests/fixtures/gpu/) were measured
# (5f08fbc), and those runs name them ("eager", "compiled": what they ran). Each kernel is
# counted as reading its inputs and writing its outputs once per pass over [b·s, V]:
#   chunked         forward per chunk the upcast (read 2, write 4), the max (4), the in-place
#                   shift (4 + 4), exp (4 + 4), the sum (4); backward per chunk the upcast
#                   (2 + 4), the in-place shift, exp and scale (3 x (4 + 4)), the copy into the
#                   gradient of the logits' dtype (4 + 2) — e = 2 logits (bf16/fp16)
#   eager           F.cross_entropy(logits[:, :V].float()): forward the upcast (read 2,
#                   write 4), log-softmax (a max pass, a sum-exp pass, the write pass: read
#                   4 + 4 + 4, write 4); backward the NLL gradient (a zero-filled fp32
#                   [b·s, V]: write 4), log-softmax's backward (a row-sum pass, then read the
#                   gradient and the output, write: 4 + 4 + 4 + 4), the upcast's (read 4,
#                   write 2), the slice's into the padded vocabulary (zeros, copy: 2 + 2 + 2)
#   compiled        train.compile with tp 1: the slice, upcast and log-softmax fused by
#                   Inductor: forward reads the bf16 logits for the max and the sum of
#                   exponentials (2 + 2; they are saved as they are), backward reads them
#                   again and writes the bf16 gradient (2 + 2)
#   vocab_parallel  tp > 1 (the former megalite.parallel.tensor one): forward the upcast (2 + 4), max (4),
#                   the shifted copy (4 + 4), exp (4 + 4), sum (4), the in-place division
#                   (4 + 4); backward the in-place scale (4 + 4) and the upcast's (4 + 2)
LOSS_BYTES_PER_LOGIT: Dict[str, Tuple[int, int]] = {
    "chunked": (30, 36), "eager": (22, 32), "compiled": (4, 4), "vocab_parallel": (38, 14)}
# The engine's step per owned parameter on the device (megalite.parallel.zero): the global
# norm (read the fp32 gradient: 4), clipping (foreach multiply: read and write, 8), fused
# AdamW (read parameter, gradient and both moments, write parameter and moments: 28); + the
# fp32 master -> model-dtype copy (4 + e) where the model is not fp32, + zeroing the gradients
# (4 bytes each, `zero_grad`).
OPTIMIZER_BYTES = 4 + 8 + 28
# offload.optimizer's host passes: `megalite.plan.offload` (HOST_*_BYTES)

def dropout_bytes(e: int) -> int:
    """Device-memory bytes a dropout site moves per element, forward + backward (eager
    `native_dropout`): read the input, write the output and a 1-byte mask; backward read the
    gradient and the mask, write the gradient."""
    return 4 * e + 2


def loss_implementation(cfg: Config, layout: Layout) -> str:
    """Which loss the run computes (a key of LOSS_BYTES_PER_LOGIT): the chunked loss, at any tp
    and with or without train.compile (which no longer wraps it)."""
    return "chunked"


def dropout_on(cfg: Config) -> bool:
    """Whether the run's residual dropout is on (the blocks' `resid_pdrop`)."""
    return cfg.model.resid_pdrop > 0


def loss_elements(cfg: Config, layout: Layout, tokens: int) -> float:
    """Logit elements a rank's loss passes over per micro-batch: the real vocabulary (tp 1:
    the loss slices the padding off) or this rank's padded slice (vocab-parallel)."""
    m, tp = cfg.model, layout.tp_size
    return tokens * (m.vocab_size if tp == 1 else padded_vocab_size(m.vocab_size, tp) / tp)
