"""What fp8.recipe adds to the plan (megalite/plan/fp8_terms.py): one FP8 product's short-lived
copies against the CPU allocator, the amax all-reduces in the TP traffic and the time model,
the casts' memory traffic. The whole step's peak against the plan: `megalite-bench
plan-memory` (docs/fp8.md)."""
from __future__ import annotations

import pytest
import torch

from megalite.bench.memory import PeakBytes
from megalite.config.schema import load_config
from megalite.parallel.fp8 import E4M3, Fp8Linear, scaled_product
from megalite.parallel.group import single_rank_group
from megalite.plan.fp8_terms import (
    amax_reductions,
    cast_traffic_bytes,
    product_bytes,
    products,
)
from megalite.plan.traffic import stage_traffic
from tests.unit.test_planner import SMALL, planned, synthetic

TOKENS, K, N = 128, 64, 256


def _operands(which: str, dtype):
    """The operands of a linear's `which` product as the FP8 function passes them (dx: Wᵀ, a
    view; dW: dyᵀ and xᵀ, views)."""
    x, w, dy = (torch.randn(TOKENS, K, dtype=dtype), torch.randn(N, K, dtype=dtype),
                torch.randn(TOKENS, N, dtype=dtype))
    return {"forward": (x, w), "dx": (dy, w.t()), "dW": (dy.t(), x.t())}[which]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_fp8_products_bytes_are_the_plans_cpu_term(recipe, dtype):
    """The most a product's casts and the emulated kernel hold at once, beyond its operands
    and output, as the CPU allocator records it, against `product_bytes` (within 1%: the
    scales)."""
    torch.manual_seed(0)
    layer = Fp8Linear(recipe, single_rank_group("tp"), True)
    e = torch.finfo(dtype).bits // 8
    shapes = products(load_config(SMALL + [f"model.n_embd={K}", f"model.n_inner={N}"]), 1,
                      TOKENS)
    planned_bytes = {"forward": shapes["forward"][2], "dx": shapes["backward"][4],
                     "dW": shapes["backward"][5]}  # c_fc's: [K -> N]
    for which, shape in planned_bytes.items():
        a, b = _operands(which, dtype)
        dtypes = (E4M3 if which == "forward" else layer.grad_dtype, E4M3)
        with PeakBytes() as peak:
            out = scaled_product(a, b, dtypes, layer, (None, None), dtype)
        expect = product_bytes(shape, e, "cpu", recipe == "rowwise")
        assert peak.bytes - out.numel() * e == pytest.approx(expect, rel=0.01), which


@pytest.mark.parametrize("recipe,calls,elements", [("tensorwise", 8, 8),
                                                   ("rowwise", 8, 4 * (32 * 8 + 64))])
def test_the_amax_all_reduces_are_in_the_tp_traffic_and_time(recipe, calls, elements):
    """tp 2: each block's amax all-reduces (fp32, 2(t-1)/t·4 wire bytes an element) in the
    plan's TP bytes; in the time model at the all-reduce's latency each, and the casts'
    memory traffic at HBM bandwidth in non_matmul."""
    over = ["tp=2", "train.global_batch_size=8", "train.micro_batch_size=8"]
    latency = 1e-3
    profile = synthetic(latency=latency)
    cfg, layout, bf16 = planned(over, 2, profile)
    fp8_cfg, _, fp8 = planned(over + [f"fp8.recipe={recipe}"], 2, profile)
    assert amax_reductions(fp8_cfg, 2) == (calls, elements)
    blocks, m = cfg.model.n_layer, 1
    wire = m * blocks * elements * 4 * 2 * (1 / 2)
    bf16_tp, fp8_tp = (stage_traffic(c, layout)[0].comm["tp"] for c in (cfg, fp8_cfg))
    assert fp8_tp - bf16_tp == pytest.approx(wire, rel=1e-12)
    assert fp8.terms["tp"] - bf16.terms["tp"] == pytest.approx(
        m * blocks * calls * latency + wire / 10e9, rel=1e-9)
    assert fp8.terms["non_matmul"] - bf16.terms["non_matmul"] == pytest.approx(
        m * blocks * cast_traffic_bytes(fp8_cfg, 2, 2) / 100e9, rel=1e-9)
