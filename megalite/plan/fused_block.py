"""The non-matmul time of a GPT block run with Megatron-LM 2021's fused kernels: a prediction,
by a memory-bound roofline, for a published run whose block megalite does not have.

megalite's own block is eager and its `non_matmul` time is measured (`calibrate_block`). The
runs of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", §4.2) fused the block's elementwise work into three kinds of kernel —
bias + GeLU, bias + dropout + residual add, scale + mask + softmax — beside Apex's fused
LayerNorm (Megatron-LM's megatron/fused_kernels and megatron/model/fused_*.py; §5.8 measured
+19% throughput at 175B, +11% at 530B from them). Each such kernel is memory-bound: this
module counts the bytes each one reads and writes in forward and backward for one block
(micro-batch b, sequence s, hidden h, heads a, TP t, no sequence parallelism: the LayerNorms
and the residual path hold all b·s·h elements on every TP rank, the MLP's activation 4h/t and
the scores b·(a/t)·s² are split), e bytes an element (2 in bf16/fp16, 4 in fp32), and prices
them at the device's HBM bandwidth, with N = b·s, S = b·(a/t)·s²:

  kernel (per block)                  forward bytes           backward bytes
  2 LayerNorms (Apex fused; mean and  2 · (2·N·h·e + 8·N)     2 · (5·N·h·e + 16·N): the
    rstd kept in fp32)                                        γ/β partial sums and the input
                                                              gradient each read dy and x
  2 bias + dropout + add              2 · 3·N·h·e             2 · (N·h·e + 3·N·h·e): the
    (+ a 1-byte mask a site, p > 0)   (+ 2·N·h)               bias gradient's read of dy; the
                                                              residual's gradient sum (dy +
                                                              the branch's); with p > 0 the
                                                              mask applied: + 2·(2·N·h·e + N·h)
  bias + GeLU on N × 4h/t             2 · N·(4h/t)·e          4 · N·(4h/t)·e: dy and x read,
                                                              dx written, and read again for
                                                              the bias gradient
  QKV bias (column-parallel linear)   2 · N·(3h/t)·e          N·(3h/t)·e (its sum)
  scale + mask + softmax (causal:     1.5 · S·e: the visible  2 · S·e: dy and y read where
    ScaledUpperTriangMaskedSoftmax)   half read, all written  visible, dx all written
  attention dropout on the            2·S·e + S               2·S·e + S
    probabilities (unfused, p > 0)
  context permute to [s, b, h/t]      2 · N·(h/t)·e           2 · N·(h/t)·e

A recomputed block (train.recompute) runs its forward kernels once more in the backward.
Assumed: the kernels reach the profile's `hbm_gbps` (the data-sheet bandwidth: a kernel at
~85% of it takes 1/0.85 longer); no launch latency (no profile carries one, and kernels this
large are queued well ahead of the GPU); parameters' reads (γ, β, biases: O(h)) neglected;
the matmuls, including the attention's two batched ones, are the time model's compute term.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Tuple

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.plan.devices import BlockFit, DeviceProfile
from megalite.plan.dims import recomputed_layers


@dataclass(frozen=True)
class FusedBlockBytes:
    """HBM bytes of one block's fused non-matmul kernels for one micro-batch on one rank."""

    forward: float
    backward: float


def fused_block_bytes(cfg: Config, layout: Layout) -> FusedBlockBytes:
    """The table of the module docstring for `cfg`'s block at `layout`'s TP and precision."""
    if layout.sequence_parallel or layout.cp_size > 1:
        raise ValueError("fused_block counts Megatron 2021's block: no sequence or context "
                         f"parallelism (sp={layout.sequence_parallel}, cp={layout.cp_size})")
    m, t = cfg.model, layout.tp_size
    e = 4 if layout.precision == "fp32" else 2
    n = cfg.train.micro_batch_size * cfg.train.seq_len
    h, s = m.n_embd, cfg.train.seq_len
    nh = n * h * e  # one full activation
    mlp, qkv, ctx = n * 4 * h / t * e, n * 3 * h / t * e, n * h / t * e
    scores = cfg.train.micro_batch_size * m.n_head / t * s * s  # elements
    resid, attn = m.resid_pdrop > 0, m.attn_pdrop > 0
    forward = (2 * (2 * nh + 8 * n) + 2 * (3 * nh + (n * h if resid else 0)) + 2 * mlp
               + 2 * qkv + 1.5 * scores * e + (scores * (2 * e + 1) if attn else 0) + 2 * ctx)
    backward = (2 * (5 * nh + 16 * n) + 2 * (4 * nh + (2 * nh + n * h if resid else 0))
                + 4 * mlp + qkv + 2 * scores * e + (scores * (2 * e + 1) if attn else 0)
                + 2 * ctx)
    return FusedBlockBytes(forward, backward)


def fused_block_seconds(cfg: Config, layout: Layout, profile: DeviceProfile
                        ) -> Tuple[float, float]:
    """(forward, backward) seconds of one block's fused kernels a micro-batch, at the
    profile's HBM bandwidth."""
    if not profile.hbm_gbps:
        raise ValueError(f"device profile {profile.name!r} has no hbm_gbps to price the fused "
                         "kernels at")
    b = fused_block_bytes(cfg, layout)
    bw = profile.hbm_gbps * 1e9
    return b.forward / bw, b.backward / bw


def fused_profile(cfg: Config, layout: Layout, profile: DeviceProfile) -> DeviceProfile:
    """`profile` with its measured eager block replaced by the fused block's roofline, so the
    time model (`megalite.plan.time_model`: a block's non_matmul a pass, a recomputed block's
    re-run a third of it) charges n·(forward + backward) + r·forward over the model's n blocks
    of which r recompute: the pass that makes its (n + r/3)·pass equal that. Its dropout is
    not recorded (the count already holds the run's), so no dropout correction applies."""
    fwd, bwd = fused_block_seconds(cfg, layout, profile)
    chunks = [c for stage in layout.stage_blocks() for c in stage]
    n = sum(len(c) for c in chunks)
    r = sum(recomputed_layers(cfg, len(c)) for c in chunks)
    per_pass = (n * (fwd + bwd) + r * fwd) / (n + r / 3)
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len / layout.tp_size
    fit = BlockFit(cfg.model.n_embd, 0.0, per_pass / tokens, None)
    return replace(profile, block_fits=(fit,))
