"""FP8 training (`fp8.recipe`, megalite/parallel/fp8.py) on CPU through `fp8.emulate`: the
scaled products against the dequantised reference, the layer's gradients, zero-bubble's
deferred weight gradient, the refusals before launch, the tiny model's loss curve against
bf16, and resuming across precisions. Parallel FP8 runs against the serial FP8 run:
tests/integration/parallel/test_fp8.py."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.layout import GpuInfo, validate
from megalite.config.schema import load_config
from megalite.parallel.fp8 import (
    E4M3,
    E5M2,
    Fp8Linear,
    fp8_linear,
    quantize,
    scaled_product,
    use_fp8,
)
from megalite.parallel.group import single_rank_group
from megalite.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from megalite.parallel.weight_grad import (
    WeightGradQueue,
    attach_weight_grad_queue,
    run_weight_grads,
)
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT, train_in_process

EMULATED = ["fp8.emulate=true"]
# 50 steps of the tiny model at micro-batch 2, global batch 4 with the default schedule's
# shape (lr 1e-3 after 10 warmup steps): measured, FP8 is within 2.5e-4 of bf16's loss at
# every step (tensorwise and rowwise); the tolerance is 1% of the loss
CURVE = ["precision=bf16", "train.micro_batch_size=2", "train.global_batch_size=4",
         "optim.lr=1e-3", "optim.warmup_steps=10"]
CURVE_STEPS, CURVE_REL = 50, 1e-2


def dequantised(t8: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    return t8.float() * inverse_scale


@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_product_is_the_dequantised_reference(rowwise):
    """The product of the FP8 operands, accumulated in fp32, equals the fp32 matmul of the
    dequantised operands; the amax lands on the format's largest finite value."""
    torch.manual_seed(0)
    a, b = torch.randn(48, 64) * 3, torch.randn(32, 64) / 5
    layer = Fp8Linear("rowwise" if rowwise else "tensorwise", single_rank_group("tp"), True)
    a8, sa = quantize(a, E4M3, rowwise, None)
    b8, sb = quantize(b, E5M2, rowwise, None)
    assert a8.dtype == E4M3 and b8.dtype == E5M2
    assert sa.shape == ((48, 1) if rowwise else ())
    top = a8.float().abs().amax(dim=-1) if rowwise else a8.float().abs().amax()
    assert torch.all(top == torch.finfo(E4M3).max)
    reference = dequantised(a8, sa) @ dequantised(b8, sb).t()
    out = scaled_product(a, b, (E4M3, E5M2), layer, (None, None), torch.float32)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    assert 0 < (out - a @ b.t()).norm() / (a @ b.t()).norm() < 0.1  # FP8's rounding, no more


def _pair(dtype):
    torch.manual_seed(1)
    group = single_rank_group("tp")
    column = ColumnParallelLinear(64, 256, group, False).to(dtype)
    row = RowParallelLinear(256, 64, group, False).to(dtype)
    for p in [*column.parameters(), *row.parameters()]:
        torch.nn.init.normal_(p, std=0.05)
    return column, row


def _grads(column, row, x):
    params = [x, *column.parameters(), *row.parameters()]
    for p in params:
        p.grad = None
    y = row(torch.nn.functional.gelu(column(x)))
    y.square().sum().backward()
    return y.detach(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linears_track_the_bf16_linears(recipe):
    """A column-parallel and a row-parallel linear in FP8: output and every gradient (input,
    weights, biases) within FP8's rounding of the bf16 layers', in the parameters' dtype."""
    column, row = _pair(torch.bfloat16)
    x = torch.randn(16, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    ref_y, ref = _grads(column, row, x)
    assert use_fp8(column, recipe) == 1 and use_fp8(row, recipe) == 1
    y, got = _grads(column, row, x)
    rel = [float((g.float() - r.float()).norm() / r.float().norm()) for g, r in zip(got, ref)]
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert 0 < float((y.float() - ref_y.float()).norm() / ref_y.float().norm()) < 0.08
    assert max(rel) < 0.1 and min(rel) > 0, rel  # measured: 0.01 - 0.075


@pytest.mark.parametrize("column", [True, False])
def test_tensorwise_scales_kept_from_forward_give_the_same_bits(column):
    """Tensorwise, the layer takes x's and W's amaxes in forward and dy's once in backward:
    output, dx and dW bitwise equal to the three products each taking its operands' amaxes
    itself."""
    torch.manual_seed(2)
    layer = Fp8Linear("tensorwise", single_rank_group("tp"), column)
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    dy = torch.randn(32, 48)
    y = fp8_linear(x, w, None, layer)
    y.backward(dy)
    none = (None, None)
    assert torch.equal(y, scaled_product(x, w, (E4M3, E4M3), layer, none, torch.float32))
    assert torch.equal(x.grad, scaled_product(dy, w.t(), (E5M2, E4M3), layer, none,
                                              torch.float32))
    assert torch.equal(w.grad, scaled_product(dy.t(), x.t(), (E5M2, E4M3), layer, none,
                                              torch.float32))


def test_fp8_weight_gradient_deferred_by_zero_bubble_equals_the_immediate_one():
    """Under a zero-bubble schedule the FP8 layer's B gives dx and its W the same dW, db."""
    column, row = _pair(torch.float32)
    use_fp8(column, "tensorwise")
    use_fp8(row, "tensorwise")
    x = torch.randn(16, 2, 64, requires_grad=True)
    _, immediate = _grads(column, row, x)
    queue = WeightGradQueue()
    for layer in (column, row):
        attach_weight_grad_queue(layer, queue)
    params = [x, *column.parameters(), *row.parameters()]
    for p in params:
        p.grad = None
    with queue.collecting() as deferred:
        row(torch.nn.functional.gelu(column(x))).square().sum().backward()
    # B: dx, and the row-parallel bias (added after the TP reduction, outside the FP8 product)
    assert [p.grad is None for p in params] == [False, True, True, True, False]
    run_weight_grads(deferred)
    for p, expect in zip(params, immediate):
        torch.testing.assert_close(p.grad, expect, rtol=0, atol=0)


def _cfg(base, **changes):
    """A copy of `base` with `section__key=value` changes (one composition for them all)."""
    cfg = copy.deepcopy(base)
    for name, value in changes.items():
        section, _, key = name.rpartition("__")
        setattr(getattr(cfg, section) if section else cfg, key, value)
    return cfg


def test_fp8_refusals_name_the_device_key_layer_and_dimension():
    base = load_config(TINY + ["fp8.recipe=tensorwise", *EMULATED])
    with pytest.raises(ConfigError, match=r"fp8.emulate=False: .*device cpu.*fp8.emulate=true"):
        validate(_cfg(base, fp8__emulate=False), 1)
    with pytest.raises(ConfigError, match=r"fp8.recipe='blockwise': use one of none, "):
        validate(_cfg(base, fp8__recipe="blockwise"), 1)
    a100 = GpuInfo("NVIDIA A100-SXM4-80GB", True, (8, 0))
    with pytest.raises(ConfigError, match=r"A100.*compute capability 8.0.*>= 8.9"):
        validate(_cfg(base, device="auto"), 1, local_gpus=1, gpu=a100)
    with pytest.raises(ConfigError, match=r"transformer.h.\*.attn.c_attn: model.n_embd = 72"):
        validate(_cfg(base, model__n_embd=72), 1)
    with pytest.raises(ConfigError, match=r"attn.c_attn: 3 \* model.n_embd / tp = 24 \(tp=4"):
        validate(_cfg(base, model__n_embd=32, tp=4), 4)
    with pytest.raises(ConfigError, match=r"mlp.c_fc: model.n_inner / tp = 40"):
        validate(_cfg(base, model__n_inner=80, tp=2), 2)
    with pytest.raises(ConfigError, match=r"train.seq_len \* train.micro_batch_size = 20 \* 2"):
        validate(_cfg(base, train__seq_len=20, train__micro_batch_size=2), 1)
    assert not any("fp8" in w for w in validate(base, 1))
    h100 = GpuInfo("NVIDIA H100 80GB HBM3", True, (9, 0))
    warnings = validate(_cfg(base, device="auto"), 1, local_gpus=1, gpu=h100)
    assert any("train.compile=false" in w for w in warnings), warnings
    assert not any("fp8" in w for w in validate(_cfg(base, device="auto", train__compile=True),
                                                  1, local_gpus=1, gpu=h100))


@pytest.mark.slow
def test_fp8_loss_curve_follows_bf16_over_50_steps(tiny_data, tmp_path):
    """The tiny model for 50 steps in bf16, and with its blocks' linears in FP8 (both
    recipes): every step's loss within 1% of bf16's, and not equal to it (FP8 ran)."""
    common = [f"data.dir={tiny_data}", *CURVE]
    bf16 = train_in_process(tmp_path / "bf16", common, CURVE_STEPS)["losses"]
    assert bf16[-1] < bf16[0] - 0.5  # it learns
    for recipe in ("tensorwise", "rowwise"):
        fp8 = train_in_process(tmp_path / recipe, common + EMULATED + [f"fp8.recipe={recipe}"],
                               CURVE_STEPS)["losses"]
        rel = [abs(a - b) / b for a, b in zip(fp8, bf16)]
        assert max(rel) < CURVE_REL, (recipe, max(rel))
        assert max(rel) > 1e-6, recipe


def _trainer(tiny_data, run_dir, *extra):
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "precision=bf16", "train.micro_batch_size=2",
        "train.global_batch_size=4", f"checkpoint.dir={run_dir}/ckpt", *extra])
    validate(cfg, 1)
    return build_trainer(cfg, init_runtime(cfg), run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [("none", "tensorwise"), ("tensorwise", "none")])
def test_fp8_and_bf16_runs_resume_each_others_checkpoints(tiny_data, tmp_path, first, then):
    """A checkpoint holds the fp32 masters whatever the matmuls ran in: a run resumes it with
    the other precision's matmuls (bf16 -> FP8, FP8 -> bf16) with the same masters and
    parameters, and its next steps' losses are within FP8's rounding (1%) of the saving run's
    own continuation."""
    trainer = _trainer(tiny_data, tmp_path / "a", f"fp8.recipe={first}", *EMULATED)
    for _ in range(3):
        trainer.train_step()
    saved = trainer.save()
    header = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[0])["run"]
    assert header["fp8"] == (None if first == "none" else {
        "recipe": first, "peak_tflops_fp8": None, "mfu_against": "bf16 peak",
        "source": "cpu: FP8 emulated (fp8.emulate), no FP8 peak"})
    masters = [p.detach().clone() for p, _, _ in trainer.engine.main_params]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    continued = [trainer.train_step()[0] for _ in range(2)]
    resumed = _trainer(tiny_data, tmp_path / "b", f"fp8.recipe={then}", *EMULATED,
                       f"checkpoint.resume={saved}")
    assert resumed.step == 3
    for (p, _, _), expect in zip(resumed.engine.main_params, masters):
        assert torch.equal(p, expect)
    for n, p in resumed.model.named_parameters():
        assert torch.equal(p, params[n]), n
    after = [resumed.train_step()[0] for _ in range(2)]
    for a, b in zip(after, continued):
        assert math.isclose(a, b, rel_tol=1e-2) and a != b, (first, then, after, continued)


def test_the_planner_prices_the_fp8_linears_at_the_fp8_rate():
    """The blocks' linears (2·(4h² + 2h·f) FLOPs a token a block, forward) at the profile's
    fp8 rate, everything else (attention, LM head) at bf16's; a profile without an fp8 rate
    (a CPU) prices them at its precision's. The table names the FP8 peak beside bf16's."""
    from dataclasses import replace

    from megalite.plan.devices import BY_NAME, table_peak_tflops
    from tests.unit.plan.test_planner import planned, synthetic

    over = ["train.global_batch_size=8", "train.micro_batch_size=2"]
    fast = replace(synthetic(), matmul_tflops={"bf16": 1.0, "fp32": 1.0, "fp8": 2.0})
    cfg, _, bf16 = planned(over, 1, fast)
    _, _, fp8 = planned(over + ["fp8.recipe=tensorwise"], 1, fast)
    h, f, s, n = cfg.model.n_embd, cfg.model.ffn_size, cfg.train.seq_len, cfg.model.n_layer
    linears = 3 * 2 * (4 * h * h + 2 * h * f) * n * 8 * s / 1e12  # the step's, at 1 TFLOP/s
    assert fp8.terms["compute"] == pytest.approx(bf16.terms["compute"] - linears / 2, rel=1e-12)
    _, _, no_rate = planned(over + ["fp8.recipe=tensorwise"], 1, synthetic())
    assert no_rate.terms["compute"] == bf16.terms["compute"]
    assert BY_NAME["h100-80gb"].rate("fp8") > BY_NAME["h100-80gb"].rate("bf16")
    assert "fp8" not in BY_NAME["a100-80gb"].matmul_tflops
    assert table_peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == (1979.0, "H100")


@pytest.mark.parametrize("form", ["full", "reduced"])
def test_the_gpu_bench_fp8_runs_validate(form):
    """megalite-bench gpu's fp8 part: each run's overrides validate for one rank on its
    device (gpt2-xl's dimensions are multiples of 16; the reduced form emulates on CPU)."""
    from megalite.train.preflight import validated_config
    from megalite_bench.gpu_fp8 import RECIPES, fp8_overrides, loss_gap
    from megalite_bench.gpu_sizes import FULL, REDUCED

    sizes = FULL if form == "full" else REDUCED
    for recipe in RECIPES:
        cfg, _ = validated_config(fp8_overrides(sizes, recipe), 1, 1,
                                  "cuda" if form == "full" else "cpu")
        assert cfg.fp8.recipe == recipe and cfg.train.compile == (form == "full")
    assert loss_gap([2.0, 3.3], [2.0, 3.0]) == pytest.approx(0.1)
