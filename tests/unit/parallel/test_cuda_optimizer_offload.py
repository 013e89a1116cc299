"""Optimizer offload on CUDA: the host state in pinned memory, gradient copies on a side
stream issued during the backward (zero 2) and summed on the offload's worker, the host
steps and parameter copies interleaved in forward order on the worker, the step returning
before the copies are waited for (the next forward waits per block), fp32 parameters equal to the run without
offload and bf16 training that tracks it. Skipped on machines without a GPU (CI); run on one
with `python -m pytest tests/unit/parallel/test_cuda_optimizer_offload.py`."""
from __future__ import annotations

import threading
from unittest import mock

import pytest
import torch

from megalite.config.schema import ModelConfig, OptimConfig
from megalite.parallel import host_range

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CFG = ModelConfig(n_layer=4, n_embd=256, n_head=4, n_positions=256, vocab_size=1000,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
S, B = 256, 4


def _engine(fraction: float, zero: int = 2, precision: str = "bf16", overlap: bool = False):
    from megalite.config.layout import Layout
    from megalite.model.gpt2.stage import GPT2
    from megalite.model.init import init_parameters
    from megalite.parallel.pipeline import PipelineSchedule
    from megalite.parallel.topology import build_topology
    from megalite.parallel.zero import ZeroEngine

    topo = build_topology(1, 1, 1)
    with torch.device("cuda"):
        model = GPT2(CFG, topo.tp_group).train()
    init_parameters(model, seed=0)
    layout = Layout.of(topo, precision=precision, zero_stage=zero)
    # eps 1e-6: the attention key bias's gradient is rounding noise (see tests/layouts.py)
    engine = ZeroEngine(model, topo, layout, OptimConfig(lr=1e-3, eps=1e-6), bucket_mb=0.5,
                        offload_optimizer=fraction, overlap_param_gather=overlap)
    schedule = PipelineSchedule(model.chunks, topo, engine, (S, B, CFG.n_embd),
                                layout.compute_dtype, torch.device("cuda"))
    return model, engine, schedule


def _batches(m: int = 2):
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, CFG.vocab_size, (m, B, S + 1), generator=g).cuda()
    return [(x[:, :-1], x[:, 1:]) for x in w]


def _step(engine, schedule, batches):
    loss = schedule.train_step(batches)
    engine.finish_grad_sync()
    engine.clip_and_step(1e-3, 1.0)
    engine.zero_grad()
    return loss.item()


def test_host_state_is_pinned_and_copies_use_a_side_stream():
    _, engine, _ = _engine(0.5)
    offload = engine.offload
    assert offload.stream is not None and offload.stream != torch.cuda.current_stream()
    assert engine.optimizer.defaults["fused"]  # the device's part: fused CUDA AdamW
    for r in offload.ranges.values():
        for t in (r.main, r.grad, r.staging, r.cast):
            assert t.device.type == "cpu" and t.is_pinned()
        assert r.cast.dtype == torch.bfloat16
        assert r.optimizer.defaults.get("fused") or r.optimizer.defaults.get("foreach")
        assert r.bucket.main.is_cuda and r.bucket.main.numel() == r.offset


def _plan_host(fraction: float, zero: int = 2, precision: str = "bf16") -> dict:
    """The plan's host bytes per rank (`StagePlan.host`) for `_engine`'s model and batch."""
    from megalite.config.layout import Layout
    from megalite.config.schema import load_config
    from megalite.plan.memory import make_plan

    cfg = load_config([f"model.{k}={getattr(CFG, k)}" for k in
                       ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size")]
                      + [f"train.seq_len={S}", f"train.micro_batch_size={B}",
                         f"train.global_batch_size={2 * B}", f"zero={zero}",
                         f"precision={precision}", f"offload.optimizer={fraction}"])
    return make_plan(cfg, Layout.from_config(cfg, 1, "cuda")).stages[0].host


def _pinned_by_torch() -> int:
    """Bytes torch's pinned allocator holds (each block rounded up to a power of two)."""
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


def test_pinned_host_memory_is_what_the_plan_counts():
    """zero 2, bf16, offload 0.5, two steps: none of the offloaded state goes through torch's
    pinned allocator (host_memory_stats' bytes do not grow: it would hold each range's
    buffers rounded up to powers of two), and what the rank pins — its one arena, registered
    exactly — with the AdamW moments is the plan's host bytes."""
    torch.cuda.synchronize()
    before = _pinned_by_torch()
    _, engine, schedule = _engine(0.5)
    for _ in range(2):
        _step(engine, schedule, _batches())
    engine.wait_for_params()
    torch.cuda.synchronize()
    assert _pinned_by_torch() == before
    offload = engine.offload
    assert offload.arena.buffer.is_pinned()
    moments = sum(2 * 4 * r.main.numel() for r in offload.ranges.values())
    assert offload.arena.nbytes + moments == offload.host_bytes()
    assert offload.host_bytes() == pytest.approx(_plan_host(0.5)["optimizer"], rel=0.01)


def test_gradient_copies_start_during_the_backward_and_parameters_return_in_order():
    """zero 3, several units, 2 micro-batches: some device->host copies are issued before
    the backward ends, each ordered after its own reduction, and folded on the offload's
    worker; in the step each bucket's host AdamW is followed by its copy back, in forward
    order, before the next bucket steps (on the worker); the step returns with every copy
    still to be waited for, and the next forward's gathers wait for each (all are consumed
    by the end of it)."""
    _, engine, schedule = _engine(1.0, zero=3)
    offload = engine.offload
    assert len(offload.order) >= 4
    events, in_backward, folds = [], [False], []
    on_launched, to_device = offload.on_launched, offload._to_device

    def spy_launched(bucket, work, reduced, source=None):
        events.append(("d2h", in_backward[0]))
        on_launched(bucket, work, reduced, source)

    def spy_to_device(r):
        events.append(("h2d", offload.order.index(r)))
        to_device(r)

    train_step = schedule.train_step

    def spy_train_step(batches, *args):
        in_backward[0] = True
        try:
            return train_step(batches, *args)
        finally:
            in_backward[0] = False

    for r in offload.order:
        opt_step = r.optimizer.step
        r.optimizer.step = (lambda r=r, s=opt_step: (events.append(("step",
                                                                     offload.order.index(r))),
                                                      s())[1])
    fold = host_range.fold
    with mock.patch.object(offload, "on_launched", spy_launched), \
            mock.patch.object(offload, "_to_device", spy_to_device), \
            mock.patch.object(schedule, "train_step", spy_train_step), \
            mock.patch.object(host_range, "fold", lambda *a: (
                folds.append(threading.current_thread().name), fold(*a))[1]):
        schedule.train_step(_batches())
        engine.finish_grad_sync()
        engine.clip_and_step(1e-3, 1.0)
        assert set(offload.pending) == {id(r.bucket) for r in offload.order}
        engine.zero_grad()
        offload.step_done()  # the worker's events all in before the next step's
        schedule.train_step(_batches())
        assert not offload.pending  # every block waited for its copy in the forward
        engine.finish_grad_sync()
        engine.zero_grad()
    assert any(kind == "d2h" and during for kind, during in events)
    assert folds and all(name.startswith("megalite-offload") for name in folds)
    after = [e for e in events if e[0] in ("step", "h2d")]
    expect = [(kind, i) for i in range(len(offload.order)) for kind in ("step", "h2d")]
    assert after == expect


@pytest.mark.parametrize("overlap", [False, True])
def test_fp32_parameters_equal_the_run_without_offload(overlap):
    """fp32 model, zero 2 (with and without overlap_param_gather, whose gathers are launched
    from the gather stream after each bucket's copy): after 4 steps every parameter with
    offload 0.5 and 1 (host fused CPU AdamW) equals the run without it (fused CUDA AdamW) to
    fp32 rounding."""
    batches = _batches()
    params = []
    for fraction in (0.0, 0.5, 1.0):
        model, engine, schedule = _engine(fraction, precision="fp32", overlap=overlap)
        for _ in range(4):
            _step(engine, schedule, batches)
            assert engine.offload is None or not engine.offload.pending  # gathers took copies
        engine.wait_for_params()
        params.append([p.detach().clone() for p in model.parameters()])
    for other in params[1:]:
        for p, q in zip(other, params[0]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_training_with_offload_tracks_the_run_without():
    """bf16 parameters, fp32 masters: 10 steps with offload 0, 0.5 and 1 (zero 2)."""
    batches = _batches()
    runs = []
    for fraction in (0.0, 0.5, 1.0):
        _, engine, schedule = _engine(fraction)
        runs.append([_step(engine, schedule, batches) for _ in range(10)])
    assert runs[0][-1] < runs[0][0] - 1.0  # memorising the batch
    for other in runs[1:]:
        torch.testing.assert_close(torch.tensor(other), torch.tensor(runs[0]),
                                   rtol=1e-2, atol=1e-2)
