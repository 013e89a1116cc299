"""What fp8.recipe adds to the plan (megalite/plan/fp8_terms.py): one FP8 product's short-lived
copies against the CPU allocator, the amax all-reduces in the TP traffic and the time model,
the casts' memory traffic. The whole step's peak against the plan: `megalite-bench
plan-memory` (docs/fp8.md)."""
from __future__ import annotations

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.fp8 import fp8_dims_refusal
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.parallel.fp8 import E4M3, Fp8Linear, scaled_product
from megalite.parallel.group import single_rank_group
from megalite.plan.auto import resolve_layout
from megalite.plan.calibrate import matmul_rates, measure_matmuls
from megalite.plan.fp8_terms import (
    amax_reductions,
    cast_traffic_bytes,
    product_bytes,
    products,
)
from megalite.plan.search import search
from megalite.plan.space import candidates
from megalite.plan.traffic import stage_traffic
from megalite_bench.memory import PeakBytes
from tests.unit.plan.test_planner import SMALL, planned, synthetic

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
    assert fp8_tp - bf16_tp == pytest.approx(wire, rel=1e-12, abs=0)
    assert fp8.terms["tp"] - bf16.terms["tp"] == pytest.approx(
        m * blocks * calls * latency + wire / 10e9, rel=1e-9)
    assert fp8.terms["non_matmul"] - bf16.terms["non_matmul"] == pytest.approx(
        m * blocks * cast_traffic_bytes(fp8_cfg, 2, 2) / 100e9, rel=1e-9)


def test_the_search_proposes_only_what_the_fp8_dimension_rule_takes():
    """The planner's space with fp8.recipe holds no tp or micro-batch the launch's multiple-of-
    16 rule refuses (one rule: `fp8_dims_refusal`): at width 64, tp 8 (64 / 8 = 8) is in the
    space in bf16 and out with FP8; at 8 positions, odd micro-batches are out."""
    over = ["model.n_layer=2", "model.n_head=8", "train.seq_len=8", "train.global_batch_size=8"]
    bf16 = load_config(SMALL + over)
    fp8 = load_config(SMALL + over + ["fp8.recipe=tensorwise"])
    assert 8 in {c.tp for c in candidates(bf16, 8, False)}
    space = candidates(fp8, 8, False)
    assert space and all(fp8_dims_refusal(fp8.model, c.tp, 8, c.micro_batch_size) is None
                         for c in space)
    assert {c.tp for c in space} == {1, 2, 4} and 1 not in {c.micro_batch_size for c in space}
    result = search(fp8, 8, synthetic(), 8, top=3)
    assert not any("fp8" in message for message in result.invalid), result.invalid


WIDE = ["train.compile=true", "model.n_embd=256"]


@pytest.mark.parametrize("extra,fp8_tflops,chosen", [(WIDE, 4.0, "tensorwise"),
                                                     (WIDE, 0.5, "none"), ([], 4.0, "none")])
def test_fp8_recipe_auto_takes_fp8_where_predicted_faster(extra, fp8_tflops, chosen):
    """layout=auto with fp8.recipe=auto: tensorwise where the profile's FP8 rate makes the
    fastest layout faster, none where it does not (a slower FP8 rate; at width 64, eager,
    the casts' memory traffic outweighs a 4x rate); refused, naming the key, on a profile
    without an FP8 rate and without layout=auto."""
    from dataclasses import replace

    over = ["layout=auto", "fp8.recipe=auto", "train.global_batch_size=8", *extra]
    profile = synthetic()
    profile = replace(profile, matmul_tflops={**profile.matmul_tflops, "fp8": fp8_tflops})
    cfg, auto = resolve_layout(load_config(SMALL + over), 2, profile, 8, {})
    assert cfg.fp8.recipe == chosen and f"fp8.recipe={chosen}" in auto.overrides
    assert f"fp8.recipe=auto chose {chosen}" in auto.why
    with pytest.raises(ConfigError, match=r"fp8.recipe='auto': the planner's device .* no "
                                          r"FP8 matmul rate"):
        resolve_layout(load_config(SMALL + over), 2, synthetic(), 8, {})
    with pytest.raises(ConfigError, match=r"fp8.recipe='auto': layout=auto chooses it"):
        validate(load_config(SMALL + ["fp8.recipe=auto"]), 1, 8)


def test_calibration_times_the_fp8_product(monkeypatch):
    """The calibration's FP8 product (`torch._scaled_mm` on e4m3 operands) runs and is timed;
    here on CPU's emulated kernel (on a GPU of compute capability >= 8.9 it is cuBLAS's: the
    profile's `fp8` rate, unmeasured on this machine). No bound on the time itself: the rate
    of one shape is the dtype's, FLOPs over seconds and back, equal up to the last bits' rounding
    (which the timed value decides, so an exact comparison failed on some timings)."""
    operands, scaled_mm = [], torch._scaled_mm

    def spy(a, b, *args, **kwargs):
        operands.append((a.dtype, b.dtype))
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    sweep = measure_matmuls([(32, 48, 64)], ["fp8"], torch.device("cpu"))
    assert operands and set(operands) == {(E4M3, E4M3)}
    assert sweep[0]["dtype"] == "fp8" and sweep[0]["tflops"] > 0
    assert matmul_rates(sweep)["fp8"] == pytest.approx(sweep[0]["tflops"], rel=1e-12, abs=0)
