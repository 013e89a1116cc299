"""FP8 on a GPU with FP8 matmuls (compute capability >= 8.9): cuBLAS's scaled products against
the dequantised reference, and the tiny model training in bf16 and with each recipe, eager and
compiled, from the same weights on the same batch. Skipped elsewhere (CI; the CPU tests of
FP8 are tests/unit/parallel/test_fp8.py); run on such a GPU with `python -m pytest
tests/unit/parallel/test_cuda_fp8.py` (megalite-bench gpu's cuda-tests part runs it)."""
from __future__ import annotations

import pytest
import torch

from megalite.config.schema import ModelConfig, OptimConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (8, 9),
    reason="needs a CUDA GPU of compute capability >= 8.9")

CFG = ModelConfig(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=1024,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cublas_scaled_products_are_the_dequantised_reference(recipe):
    from megalite.parallel.fp8 import E4M3, E5M2, Fp8Linear, quantize, scaled_product
    from megalite.parallel.group import single_rank_group

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 128, device="cuda", generator=g).bfloat16()
    b = torch.randn(64, 128, device="cuda", generator=g).bfloat16()
    layer = Fp8Linear(recipe, single_rank_group("tp"), True)
    second = E4M3 if recipe == "rowwise" else E5M2
    a8, sa = quantize(a, E4M3, layer.rowwise, None)
    b8, sb = quantize(b, second, layer.rowwise, None)
    reference = (a8.float() * sa) @ (b8.float() * sb).t()
    out = scaled_product(a, b, (E4M3, second), layer, (None, None), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)


def _losses(recipe: str, compile: bool):
    from megalite.config.layout import Layout
    from megalite.model.gpt2.stage import GPT2
    from megalite.model.init import init_parameters
    from megalite.parallel.fp8 import use_fp8
    from megalite.parallel.pipeline import PipelineSchedule
    from megalite.parallel.topology import build_topology
    from megalite.parallel.zero import ZeroEngine

    device = torch.device("cuda")
    topo = build_topology(1, 1, 1)
    with torch.device(device):
        model = GPT2(CFG, topo.tp_group, compile=compile)
    init_parameters(model, seed=0)
    use_fp8(model, recipe)
    engine = ZeroEngine(model, topo, Layout.of(topo, precision="bf16"), OptimConfig(lr=1e-3))
    schedule = PipelineSchedule(model.chunks, topo, engine, (64, 4, CFG.n_embd),
                                torch.bfloat16, device)
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, CFG.vocab_size, (4, 65), generator=g).cuda()
    losses = []
    for _ in range(20):
        losses.append(schedule.train_step([(w[:, :-1], w[:, 1:])]).item())
        engine.finish_grad_sync()
        engine.clip_and_step(1e-3, 1.0)
        engine.zero_grad()
    return losses


@pytest.mark.parametrize("compile", [False, True])
def test_fp8_training_follows_bf16(compile):
    """20 steps memorising one batch: each recipe's losses within 2% of bf16's (FP8's
    rounding), and different from them (FP8 ran)."""
    bf16 = _losses("none", compile)
    assert bf16[-1] < bf16[0] - 1.0
    for recipe in ("tensorwise", "rowwise"):
        fp8 = _losses(recipe, compile)
        gaps = [abs(a - b) / b for a, b in zip(fp8, bf16)]
        assert max(gaps) < 0.02 and max(gaps) > 0, (recipe, gaps)
