"""Activation offload on CUDA: pinned host buffers, copies out and back on two side streams,
device memory freed after the forward and bounded by the blocks in transit during the step,
the same gradients. Skipped on machines without a GPU (CI); run on
one with `python -m pytest tests/unit/model/test_cuda_offload.py`."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from megalite.config.schema import ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CFG = ModelConfig(n_layer=4, n_embd=256, n_head=4, n_positions=512, vocab_size=1000,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
S, B = 512, 8


def _models(dtype=torch.float32):
    from megalite.model.activation_offload import ActivationOffload
    from megalite.model.gpt2.stage import GPT2
    from megalite.model.init import init_parameters

    offload = ActivationOffload(torch.device("cuda"))
    with torch.device("cuda"):
        plain = GPT2(CFG).train()
        offloaded = GPT2(CFG, offload=offload).train()
    init_parameters(plain, seed=0)
    offloaded.load_state_dict(plain.state_dict())
    return plain.to(dtype), offloaded.to(dtype), offload


def _batch():
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, CFG.vocab_size, (B, S + 1), generator=g).cuda()
    return w[:, :-1], w[:, 1:]


def _settled_allocated() -> int:
    """Bytes allocated once every stream's work is done (record_stream'd blocks released)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def test_offloaded_forward_frees_device_memory_and_gives_the_same_gradients():
    plain, offloaded, offload = _models()
    x, y = _batch()
    results = []
    for model in (plain, offloaded):
        before = _settled_allocated()
        loss = model(x, y)
        held = _settled_allocated() - before  # what the graph keeps on the device
        loss.backward()
        results.append((held, loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (held_plain, loss_plain, grads_plain), (held_off, loss_off, grads_off) = results
    # every block offloaded: only the embedding output's consumers outside the blocks, ln_f
    # and the loss stay on the device
    assert held_off < 0.35 * held_plain, (held_off, held_plain)
    assert offload.held_bytes == 0 and offload.take_peak() > 0.5 * held_plain
    torch.testing.assert_close(loss_off, loss_plain, rtol=0, atol=0)
    for a, b in zip(grads_plain, grads_off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_copies_go_to_pinned_memory_on_a_side_stream():
    from megalite.model import activation_offload

    _, offloaded, offload = _models(torch.bfloat16)
    current = torch.cuda.current_stream()
    assert offload.d2h is not None and offload.h2d is not None
    assert len({offload.d2h, offload.h2d, current}) == 3
    hosts, restored = [], []
    copy_out = activation_offload._SavedBlock._copy_out

    def spy(self, t):
        host = copy_out(self, t)
        hosts.append(host)
        return host

    restore = activation_offload._SavedBlock.restore

    def spy_restore(self):
        restore(self)
        restored.extend(s.device.device for s in self.slots if s.device is not None)

    with mock.patch.object(activation_offload._SavedBlock, "_copy_out", spy), \
            mock.patch.object(activation_offload._SavedBlock, "restore", spy_restore):
        loss = offloaded(*_batch())
        loss.backward()
    torch.cuda.synchronize()
    assert hosts and all(h.is_pinned() and h.device.type == "cpu" for h in hosts)
    assert restored and all(d.type == "cuda" for d in restored)
    assert offload.held_bytes == 0


def test_host_copies_are_pinned_as_counted_and_reused():
    """Every block offloaded, bf16, two forward + backward passes: none of the host copies
    goes through torch's pinned allocator (host_memory_stats' bytes do not grow: it would
    round each copy up to a power of two); the rank's pool pins the most bytes held at once
    (`take_peak`, what the plan counts: tests/integration/model/test_activation_offload.py)
    in whole pages, and the second pass reuses the first's buffers."""
    from megalite.parallel.host_arena import PAGE

    _, offloaded, offload = _models(torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    reserved = []
    for _ in range(2):
        offloaded(*_batch()).backward()
        torch.cuda.synchronize()
        reserved.append(offload.pool.reserved)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    peak, buffers = offload.take_peak(), len(offload.pool.whole)
    assert peak <= reserved[0] < peak + PAGE * buffers
    assert reserved[1] == reserved[0] and offload.held_bytes == 0


def test_the_step_peak_is_bounded_by_the_blocks_in_transit():
    """Every block offloaded (4): the peak device memory of a forward + backward is below
    the plain run's by at least 4 - IN_TRANSIT - 0.5 blocks' activations (the copies out
    are waited for before more than IN_TRANSIT blocks are on the device; restores are
    bounded alike)."""
    from megalite.model.activation_offload import IN_TRANSIT
    from megalite.model.gpt2.family import layer_activation_bytes

    peaks = []
    for model in _models()[:2]:
        x, y = _batch()
        _settled_allocated()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x, y).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    layer = layer_activation_bytes(S, B, CFG.n_embd, CFG.n_head, 1, False, 4)
    assert peaks[1] <= peaks[0] - (CFG.n_layer - IN_TRANSIT - 0.5) * layer, (peaks, layer)


def test_training_steps_with_offload_track_the_run_without():
    """bf16 parameters, fp32 masters, fused AdamW: 10 steps with and without offload."""
    from megalite.config.layout import Layout
    from megalite.config.schema import OptimConfig
    from megalite.parallel.pipeline import PipelineSchedule
    from megalite.parallel.topology import build_topology
    from megalite.parallel.zero import ZeroEngine

    topo = build_topology(1, 1, 1)
    losses = []
    for model in _models()[:2]:  # the engine casts to bf16
        engine = ZeroEngine(model, topo, Layout.of(topo, precision="bf16"), OptimConfig(lr=1e-3))
        schedule = PipelineSchedule(model.chunks, topo, engine, (S, B, CFG.n_embd),
                                    torch.bfloat16, torch.device("cuda"))
        run = []
        for _ in range(10):
            run.append(schedule.train_step([_batch()]).item())
            engine.finish_grad_sync()
            engine.clip_and_step(1e-3, 1.0)
            engine.zero_grad()
        losses.append(run)
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]),
                               rtol=1e-2, atol=1e-2)
