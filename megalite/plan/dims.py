"""The sizes every term of a layout's plan is built from (`megalite.plan.memory`'s docstring
has the formulas): the compute dtype's bytes, the padded vocabulary, the residual stream's
positions per rank, the micro-batches, one block's activation bytes and parameters per TP rank,
and how many of a chunk's blocks are recomputed or offloaded."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.model.activation_offload import offloaded_blocks
from megalite.parallel.cross_entropy import chunk_rows
from megalite.parallel.param_spec import padded_vocab_size


def ring(n: int) -> float:
    return (n - 1) / n


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool, e: int,
                           dropout: bool = False, math_attention: bool = False) -> float:
    """Bytes one transformer layer keeps for backward per micro-batch (the module docstring's
    formula): e·sbh(4 + 12/t), or e·sbh·16/t with SP, + LayerNorm statistics, the attention
    log-sum-exp and, with dropout, the residual dropout masks. `math_attention`: SDPA's math
    kernel (attention dropout on a CPU, or train.attention=math), which keeps no log-sum-exp
    but the probabilities, their dropout mask and the dropped probabilities (3·e·b(a/t)s²)
    and the scaled q and k (2·e·sbh/t)."""
    s_local = s // t if sp else s
    main = e * s * b * h * (16 / t if sp else 4 + 12 / t)
    heads = a // t
    attention = 3 * e * b * heads * s * s + 2 * e * s * b * h / t if math_attention \
        else 4 * heads * s * b
    return main + 16 * s_local * b + attention + (2 * s_local * b * h if dropout else 0)


def math_attention(cfg: Config, layout: Layout) -> bool:
    """Whether SDPA runs its math kernel: asked for, or attention dropout on a CPU (whose
    flash kernel has no dropout)."""
    return cfg.train.attention == "math" or (layout.device_type == "cpu"
                                             and cfg.model.attn_pdrop > 0)


def loss_bytes(tokens: int, cols: int, e: int, tp: int) -> Dict[str, float]:
    """The chunked cross-entropy's bytes on one rank (`megalite.parallel.cross_entropy`) for
    `tokens` tokens and `cols` columns of e-byte logits:

      saved     e·N·C the logits (the LM head's output, kept for the backward) + per token
                the local targets (8), their mask (1), the max (4) and log-sum-exp (4;
                with TP the max is a copy and the (target logit, sum) pair of 8 holds it)
      forward   one fp32 chunk, 4·R·C (R = min(N, `chunk_rows(C)`)) + 4 fp32 [N] vectors
      backward  the gradient of the logits e·N·C + one fp32 chunk + 2 fp32 [N] vectors

    `forward` / `backward`: what each adds at its peak to the saved bytes."""
    chunk = 4 * min(tokens, chunk_rows(cols)) * cols
    return {"saved": e * tokens * cols + (17 if tp == 1 else 21) * tokens,
            "forward": chunk + 16 * tokens,
            "backward": e * tokens * cols + chunk + 8 * tokens}


def recomputed_layers(cfg: Config, stage_layers: int) -> int:
    """How many of a stage's blocks re-run their forward in backward."""
    if not cfg.train.recompute:
        return 0
    limit = cfg.train.recompute_layers
    return stage_layers if limit is None else min(limit, stage_layers)


def offloaded_layers(cfg: Config, stage_layers: int) -> int:
    """How many of a chunk's blocks keep their saved tensors in host memory."""
    if not cfg.offload.activations:
        return 0
    return len(offloaded_blocks(stage_layers, recomputed_layers(cfg, stage_layers),
                                cfg.offload.activations_layers))


@dataclass(frozen=True)
class Dims:
    """The sizes every term of a plan is built from."""

    cfg: Config
    layout: Layout
    e: int  # bytes of the compute dtype
    vocab: int  # padded vocabulary
    s_local: int  # positions of the residual stream per rank (s/t with SP)
    micro: int  # micro-batches per step
    layer_act_full: float  # activation bytes one layer keeps (no recompute)
    layer_params: int  # parameter elements of one block on one TP rank
    full: float  # bytes of one full activation [s, b, h]


def dims(cfg: Config, layout: Layout) -> Dims:
    m, t, tp = cfg.model, cfg.train, layout.tp_size
    e = 4 if layout.precision == "fp32" else 2
    h, f = m.n_embd, m.ffn_size
    return Dims(
        cfg=cfg, layout=layout, e=e, vocab=padded_vocab_size(m.vocab_size, tp),
        s_local=layout.activation_seq_len(t.seq_len),
        micro=layout.micro_batches(t.global_batch_size),
        layer_act_full=layer_activation_bytes(t.seq_len, t.micro_batch_size, h, m.n_head, tp,
                                              layout.sequence_parallel, e, m.resid_pdrop > 0,
                                              math_attention(cfg, layout)),
        layer_params=(4 * h + (3 * h * h + 3 * h) // tp + h * h // tp + h
                      + (f * h + f) // tp + h * f // tp + h),
        full=e * t.seq_len * t.micro_batch_size * h)
