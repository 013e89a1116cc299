"""What a transformer block's forward + backward costs beyond its matmul FLOPs, measured by
`scripts/plan.py --calibrate` for the planner's `non_matmul` term (a block of the model's family).

The time model counts a block's forward as 2·P_block + 4·h·s FLOPs a token at the achievable
matmul rate R (backward 2 forwards). A real block also runs LayerNorms, GELU, the attention
softmax, residual adds, dropout, autograd's bookkeeping and, per operation, a kernel launch or
(on CPU) the dispatcher's Python and C++ overhead — work the FLOP count does not see. This
module times a real block of the model's family (`megalite.model.families.make_block`: tp 1,
the model's width, heads, MLP and
sequence length) forward + backward at two token counts T1 = s·b and T2 = 2·s·b (b =
train.micro_batch_size), takes off the FLOP count at R, and fits the rest per block pass as

    non_matmul(T) = fixed_s + per_token_s · T        (through the two points; a part that
                                                       would be negative is 0 and the other
                                                       fitted alone)

around the calibrated micro-batch: where the matmul rate itself changes with the shape (CPU
caches), what the rate at T1 misses at other sizes lands in per_token_s.

so a micro-batch of T tokens on a stage of n blocks costs n · non_matmul(T) beyond the FLOPs
(`megalite.plan.time_model`, with TP: per_token_s · T / tp, the split attention and MLP
being the bulk of it). Measured, never assumed: a profile without it (the device table's
entries) predicts no such time.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Dict

import torch

from megalite.config.layout import PRECISION_DTYPES
from megalite.config.schema import ModelConfig
from megalite.model.families import family, make_block
from megalite.parallel.group import single_rank_group


def block_forward_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """2·P_block + 4·a·s (a = n_head · head_dim, h unless head_dim is set apart): the time
    model's forward FLOPs per token of one block."""
    return 2 * family(model).block_parameters(model) + 4 * model.n_head * model.head_size * seq_len


def time_block(model: ModelConfig, seq_len: int, batch: int, dtype: torch.dtype,
               device: torch.device, budget_s: float = 0.5, max_timings: int = 8,
               compile: bool = False) -> float:
    """Best seconds of one forward + backward of a block (in training mode: the model's
    dropout on) over up to `max_timings` timings within about `budget_s` (after a warm-up
    pass, which compiles it with `compile`, as train.compile compiles each block's forward)."""
    torch.manual_seed(0)
    block = make_block(model, tp_group=single_rank_group("tp"), sp=False,
                       tp_region=contextlib.nullcontext,
                       residual_region=contextlib.nullcontext).to(device=device, dtype=dtype)
    if compile:
        block.forward = torch.compile(block.forward)
    x = torch.randn(seq_len, batch, model.n_embd, device=device, dtype=dtype,
                    requires_grad=True)
    grad = torch.randn_like(x)

    def one() -> None:
        block(x).backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return best_time(one, budget_s, max_timings)


def best_time(run: Callable[[], None], budget_s: float, max_timings: int) -> float:
    """Best seconds of `run` (which waits for its device) over up to `max_timings` timings
    within about `budget_s`, after one untimed warm-up call."""
    run()
    best, start = math.inf, time.perf_counter()
    for _ in range(max_timings):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


def fit_nonnegative_line(x, y):
    """(a, c) >= 0 minimising Σ (a + c·x − y)²: the line through the points, or with the
    offending part at 0 the best line of the other."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((v - mx) ** 2 for v in x)
    c = sum((u - mx) * (v - my) for u, v in zip(x, y)) / sxx
    a = my - c * mx
    if c < 0:
        return max(0.0, my), 0.0
    if a < 0:
        return 0.0, max(0.0, sum(u * v for u, v in zip(x, y)) / sum(u * u for u in x))
    return a, c


def measure_block_overhead(model: ModelConfig, seq_len: int, micro_batch: int, dtype: str,
                           rate_tflops: float, device: torch.device,
                           compile: bool = False) -> Dict[str, object]:
    """The profile's `block_overhead` entry (module docstring), in `dtype` at the matmul rate
    `rate_tflops` measured for it; it records the block's width, its dropout (the time model
    corrects a run whose dropout differs) and whether it was compiled."""

    flops = 3 * block_forward_flops_per_token(model, seq_len)
    batches = (micro_batch, 2 * micro_batch)
    tokens = [seq_len * b for b in batches]
    seconds = [time_block(model, seq_len, b, PRECISION_DTYPES[dtype], device, compile=compile)
               for b in batches]
    rest = [t - flops * n / (rate_tflops * 1e12) for t, n in zip(seconds, tokens)]
    fixed, per_token = fit_nonnegative_line(tokens, rest)
    return {"fixed_s": fixed, "per_token_s": per_token, "dtype": dtype,
            "n_embd": model.n_embd, "seq_len": seq_len, "tokens": tokens,
            "seconds": seconds, "dropout": model.resid_pdrop, "compiled": compile}
