"""The CUDA path: bf16 (or fp16, loss-scaled) parameters with fp32 master weights and
moments, fused AdamW, SDPA's flash kernel, torch.compile. Skipped on machines without a GPU
(CI); run on one with `python -m pytest tests/unit/parallel/test_cuda.py`."""
from __future__ import annotations

import pytest
import torch

from megalite.config.schema import ModelConfig, OptimConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CFG = ModelConfig(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=1000,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _engine(compile: bool = False, dtype: torch.dtype = torch.bfloat16):
    from megalite.config.layout import PRECISION_DTYPES, Layout
    from megalite.model.gpt2.stage import GPT2
    from megalite.model.init import init_parameters
    from megalite.parallel.pipeline import PipelineSchedule
    from megalite.parallel.topology import build_topology
    from megalite.parallel.zero import ZeroEngine

    device = torch.device("cuda")
    topo = build_topology(1, 1, 1)
    with torch.device(device):
        model = GPT2(CFG, topo.tp_group, compile=compile)
    init_parameters(model, seed=0)
    precision = {v: k for k, v in PRECISION_DTYPES.items()}[dtype]
    engine = ZeroEngine(model, topo, Layout.of(topo, precision=precision), OptimConfig(lr=1e-3))
    schedule = PipelineSchedule(model.chunks, topo, engine, (64, 4, CFG.n_embd), dtype, device)
    return model, engine, schedule


@pytest.mark.parametrize("compile,dtype,scale", [(False, torch.bfloat16, 1.0),
                                                 (True, torch.bfloat16, 1.0),
                                                 (False, torch.float16, 1024.0)])
def test_reduced_precision_training_with_fp32_master_weights(compile, dtype, scale):
    model, engine, schedule = _engine(compile, dtype)
    assert all(p.dtype == dtype and p.is_cuda for p in model.parameters())
    assert all(b.main.dtype == torch.float32 for b in engine.buckets)
    assert engine.optimizer.defaults["fused"]
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, CFG.vocab_size, (4, 65), generator=g).cuda()
    batch = [(w[:, :-1], w[:, 1:])]
    losses = []
    for _ in range(20):
        losses.append(schedule.train_step(batch, loss_scale=scale).item())
        engine.finish_grad_sync()
        engine.clip_and_step(1e-3, 1.0, grad_scale=scale)
        engine.zero_grad()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0, losses  # memorising one batch
    state = engine.optimizer.state[engine.main_params[0][0]]
    assert state["exp_avg"].dtype == torch.float32


def test_flash_attention_kernel_is_used_for_bf16():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if flash cannot run these inputs
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_peak_comes_from_the_device_table():
    from megalite.train.metrics import peak_tflops

    name = torch.cuda.get_device_name()
    peak = peak_tflops(torch.device("cuda"), None)
    if peak.tflops is None:
        assert "log.peak_tflops" in peak.source and name in peak.source
        pytest.skip(f"{name} is not in the peak table")
    assert peak.source.startswith(f"table: {name} dense bf16 (") and peak.tflops > 0
    if "H100" in name and "PCIe" not in name and "NVL" not in name:
        assert peak.tflops == 989.0


@pytest.mark.parametrize("choice", ["flash", "cudnn", "efficient"])
def test_attention_kernels_agree_with_math_in_bf16(choice):
    from megalite.model.gpt2.stage import GPT2
    from megalite.model.init import init_parameters

    g = torch.Generator().manual_seed(3)
    w = torch.randint(0, CFG.vocab_size, (4, 65), generator=g).cuda()
    out = {}
    for c in ("math", choice):
        with torch.device("cuda"):
            model = GPT2(CFG, attention=c)
        init_parameters(model, seed=0)
        model.to(torch.bfloat16)
        loss = model(w[:, :-1], w[:, 1:])
        loss.backward()
        grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        out[c] = (loss.float().item(), grad)
    assert abs(out[choice][0] - out["math"][0]) <= 1e-2 * abs(out["math"][0])
    diff = (out[choice][1] - out["math"][1]).norm() / out["math"][1].norm()
    assert diff <= 3e-2, diff


def test_background_save_from_the_gpu_equals_a_save_in_the_loop(tmp_path):
    """checkpoint.async_save on CUDA: the snapshot goes through pinned host memory, and the
    background checkpoint holds the state of its step although training went on meanwhile."""
    from megalite.checkpoint.async_save import CheckpointSaver
    from megalite.checkpoint.save import save_checkpoint, written_numel
    from megalite.checkpoint.state import META, RANK, TOP, Part, ProcessRNG, Progress, RunState
    from megalite.config.schema import load_config
    from megalite.data.sampler import ResumableSampler
    from megalite.parallel.rng import RNGTracker

    model, engine, schedule = _engine()
    cfg = load_config(["device=cuda"])
    topo = engine.topo
    w = torch.randint(0, CFG.vocab_size, (4, 65), generator=torch.Generator().manual_seed(0))
    batch = [(w[:, :-1].cuda(), w[:, 1:].cuda())]

    def step():
        schedule.train_step(batch)
        engine.finish_grad_sync()
        engine.clip_and_step(1e-3, 1.0)
        engine.zero_grad()

    step()
    progress = Progress(step=1)
    state = RunState([
        Part("progress", progress, TOP),
        Part("sampler", ResumableSampler(8, 4, 0, 1, 0, consumed_samples=4), META),
        Part("rng", ProcessRNG(RNGTracker(0, 0, 0, 0, torch.device("cuda")), 0, progress),
             RANK)]).capture()
    saver = CheckpointSaver(tmp_path / "bg", cfg, topo, torch.device("cuda"), background=True,
                            state_numel=written_numel(engine, topo))
    assert saver._staging.is_pinned()
    saver.save(engine, state)
    sync = save_checkpoint(tmp_path / "loop", engine, state, cfg, topo, keep=1)
    step()  # overwrites the live state while the background save may still be writing
    background = saver.close()
    assert (background / "rank00000.bin").read_bytes() == (sync / "rank00000.bin").read_bytes()
