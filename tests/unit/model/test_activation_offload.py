"""Activation offload (offload.activations): the saved tensors of the offloaded blocks go to
host memory and come back, parameters never move, training equals the run without it (alone,
with partial recompute, under pp2 with several micro-batches in flight, tp2 + SP, interleaved
zero 3), and the plan's host bytes are what the hooks held. On CPU host = device: the same
code path runs (tests/unit/model/test_cuda_offload.py covers pinned memory and the side stream)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn as nn

from megalite.config.errors import ConfigError
from megalite.config.layout import Layout, validate
from megalite.config.schema import ModelConfig, load_config
from megalite.model import activation_offload
from megalite.model.activation_offload import ActivationOffload, offloaded_blocks
from megalite.model.gpt2.family import layer_activation_bytes
from megalite.model.gpt2.stage import GPT2
from megalite.model.init import init_parameters
from megalite.plan.memory import make_plan
from megalite.train.host_memory import check_host_memory
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

CFG = ModelConfig(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=1024,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
S, B = 32, 4


def test_offloaded_blocks_follow_the_recomputed_ones():
    assert offloaded_blocks(4, 0, None) == range(0, 4)
    assert offloaded_blocks(4, 1, None) == range(1, 4)
    assert offloaded_blocks(4, 1, 2) == range(1, 3)
    assert offloaded_blocks(4, 0, 9) == range(0, 4)
    assert len(offloaded_blocks(2, 2, None)) == 0  # everything recomputed


def _batch():
    w = torch.randint(0, CFG.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(0))
    return w[:, :-1], w[:, 1:]


def _grads(model: GPT2, seed: int = 1):
    torch.manual_seed(seed)
    loss = model(*_batch())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradients_equal_the_run_without_offload(dropout):
    """With partial recompute (block 0 re-run, blocks 1-2 offloaded) and dropout (its masks are
    saved tensors too): the same loss and bit-identical gradients; nothing held afterwards."""
    cfg = ModelConfig(**{**CFG.__dict__, "resid_pdrop": dropout, "attn_pdrop": dropout})
    plain = GPT2(cfg, recompute=True, recompute_layers=1).train()
    init_parameters(plain, seed=0)
    offload = ActivationOffload(torch.device("cpu"))
    offloaded = GPT2(cfg, recompute=True, recompute_layers=1, offload=offload).train()
    offloaded.load_state_dict(plain.state_dict())
    (loss_a, grads_a), (loss_b, grads_b) = _grads(plain), _grads(offloaded)
    assert torch.equal(loss_a, loss_b)
    for name, grad in grads_a.items():
        assert torch.equal(grad, grads_b[name]), name
    assert offload.offloaded_tensors > 0 and offload.held_bytes == 0


def test_parameters_are_never_offloaded_activations_are():
    """Parameters live in one flat buffer (as the ZeRO engine keeps them): no storage the hooks
    copy is a parameter's; the bytes copied are the offloaded blocks' activations (the plan's
    per-layer formula, exact at dropout 0); each block's 8 saved parameters stay in place."""
    offload = ActivationOffload(torch.device("cpu"))
    model = GPT2(CFG, recompute=True, recompute_layers=1, offload=offload).train()
    init_parameters(model, seed=0)
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    start = 0
    for p in params:
        p.data = flat[start:start + p.numel()].view_as(p)
        start += p.numel()
    moved = []
    copy_out = activation_offload._SavedBlock._copy_out

    def spy(self, t):
        moved.append(t.untyped_storage()._cdata)
        return copy_out(self, t)

    with mock.patch.object(activation_offload._SavedBlock, "_copy_out", spy):
        loss = model(*_batch())
    assert flat.untyped_storage()._cdata not in moved
    assert offload.kept_tensors == 2 * 8
    layer = layer_activation_bytes(S, B, CFG.n_embd, CFG.n_head, 1, False, 4)
    assert offload.held_bytes == 2 * layer
    loss.backward()
    assert offload.held_bytes == 0 and offload.take_peak() == 2 * layer


def test_backward_prefetches_the_block_before():
    """Each block comes back once; every block but the last forward one is copied back while
    the block after it runs its backward (its copy is issued before that block's last unpack),
    before its own first unpack."""
    offload = ActivationOffload(torch.device("cpu"))
    model = GPT2(CFG, offload=offload).train()
    init_parameters(model, seed=0)
    saved = activation_offload._SavedBlock
    events, order = [], []
    copy_out, restore, unpack = saved._copy_out, saved.restore, saved.unpack

    def spy_copy_out(self, t):
        if self not in order:
            order.append(self)
        return copy_out(self, t)

    def spy_restore(self):
        if any(slot.device is None and not slot.consumed for slot in self.slots):
            events.append(("copy", order.index(self)))
        restore(self)

    def spy_unpack(self, h):
        out = unpack(self, h)
        events.append(("unpack", order.index(self)))
        return out

    with mock.patch.object(saved, "_copy_out", spy_copy_out), \
            mock.patch.object(saved, "restore", spy_restore), \
            mock.patch.object(saved, "unpack", spy_unpack):
        model(*_batch()).backward()
    blocks = len(order)
    assert blocks == CFG.n_layer
    copies = [i for kind, i in events if kind == "copy"]
    assert copies == list(range(blocks - 1, -1, -1))  # once each, last block first
    for b in range(blocks - 1):
        copied = events.index(("copy", b))
        first_use = events.index(("unpack", b))
        assert ("unpack", b + 1) in events[copied:first_use], (b, events)


def test_metrics_report_each_intervals_peak_host_bytes():
    from types import SimpleNamespace

    from megalite.parallel.group import single_rank_group
    from megalite.train.trainer import Trainer

    offload = ActivationOffload(torch.device("cpu"))
    model = GPT2(CFG, offload=offload).train()
    init_parameters(model, seed=0)
    trainer = SimpleNamespace(model=SimpleNamespace(activation_offload=offload),
                              engine=SimpleNamespace(offload=None),
                              topo=SimpleNamespace(world_group=single_rank_group("world")),
                              rt=SimpleNamespace(device=torch.device("cpu")))
    model(*_batch()).backward()
    layer = layer_activation_bytes(S, B, CFG.n_embd, CFG.n_head, 1, False, 4)
    key = "activation_offload_host_peak_bytes"
    assert Trainer._offload_memory(trainer) == {key: CFG.n_layer * layer}
    assert Trainer._offload_memory(trainer) == {key: 0}  # nothing held since
    trainer.model.activation_offload = None
    assert Trainer._offload_memory(trainer) == {}


class _SavesAWeightView(nn.Module):
    """Saves `w.t()` (a view sharing the parameter's storage, not a Parameter) and
    activations; its storage is freed after forward and refilled before backward, as ZeRO-3
    does with a gathered unit."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return torch.tanh(torch.matmul(x, self.w.t())) * x


def test_a_view_of_a_freed_and_regathered_parameter_stays_in_place():
    def run(offload):
        module = _SavesAWeightView()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        saved = module.w.detach().clone()
        if offload is None:
            y = module(x)
        else:
            with offload.chain().block(module):
                y = module(x)
        storage = module.w.untyped_storage()
        storage.resize_(0)  # freed after forward ...
        storage.resize_(saved.numel() * 4)  # ... gathered again for backward
        module.w.data.copy_(saved)
        y.sum().backward()
        return x.grad, module.w.grad

    offload = ActivationOffload(torch.device("cpu"))
    for got, want in zip(run(offload), run(None)):
        assert torch.equal(got, want)
    assert offload.kept_tensors == 1  # w.t()
    assert offload.offloaded_tensors == 4  # x (matmul, mul), tanh's output (tanh, mul) ...
    assert offload.take_peak() == 2 * 4 * 8 * 4  # ... in two copies


@pytest.mark.parametrize("overrides", [["offload.activations=true", "offload.activations_layers=0"],
                                       ["offload.activations=true", "offload.activations_layers=-1"],
                                       ["offload.activations_layers=2"]])
def test_bad_offload_layers_are_refused(overrides):
    with pytest.raises(ConfigError, match=r"offload\.activations_layers="):
        validate(load_config(TINY + overrides), 1)


def test_cpu_offload_says_it_saves_nothing():
    warnings = validate(load_config(TINY + ["offload.activations=true"]), 1)
    assert any("offload.activations=true on CPU" in w and "saves nothing" in w for w in warnings)
    warnings = validate(load_config(TINY + ["offload.activations=true", "train.recompute=true"]), 1)
    assert any("offloads nothing" in w for w in warnings)


def test_not_enough_host_memory_is_refused_naming_both_numbers():
    cfg = load_config(["model=gpt2-xl", "offload.activations=true", "train.seq_len=1024",
                       "train.micro_batch_size=8", "train.global_batch_size=64"])
    layout = Layout.from_config(cfg, 8, "cuda")
    per_rank = max(s.host["total"] for s in make_plan(cfg, layout).stages)
    check_host_memory(cfg, layout, 8, available=int(8 * per_rank) + 1)  # fits
    with pytest.raises(ConfigError, match=r"offload\.activations=True") as e:
        check_host_memory(cfg, layout, 8, available=int(8 * per_rank) - 2**30)
    need, have = f"{8 * per_rank / 2**30:.2f} GiB", f"{(8 * per_rank - 2**30) / 2**30:.2f} GiB"
    assert need in str(e.value) and have in str(e.value), str(e.value)
    big = load_config(["model=gpt2-xl", "offload.activations=true", "train.seq_len=1024",
                       "train.micro_batch_size=4096", "train.global_batch_size=32768"])
    with pytest.raises(ConfigError, match="available on this node"):  # this machine's memory
        check_host_memory(big, Layout.from_config(big, 8, "cuda"), 8)


def test_plan_moves_the_offloaded_layers_to_host():
    """pp2, m=4: stage 0 holds 2 micro-batches; each offloaded layer's bytes move from the
    device column to the host column; the device keeps 2 layers in transit."""
    base = TINY + FP32_NO_DROPOUT + ["model.n_layer=4", "pp=2", "train.micro_batch_size=1",
                                     "train.global_batch_size=4"]
    plans = [make_plan(c, Layout.from_config(c, 2, "cpu")) for c in (
        load_config(base), load_config(base + ["offload.activations=true",
                                               "offload.activations_layers=1"]))]
    off, on = plans[0].stages[0], plans[1].stages[0]
    layer = layer_activation_bytes(32, 1, 64, 4, 1, False, 4)
    assert on.host["total"] == 2 * layer  # 1 layer x 2 micro-batches in flight
    assert on.bytes["activations"] + on.host["total"] == off.bytes["activations"] + 2 * layer
    assert plans[1].placement["A"] == "offloaded (the first 1 block per stage) to host memory"
    assert "host MiB" in plans[1].table() and "host" not in plans[0].table().splitlines()[2]


class _PendingCopy:
    """A stand-in for the CUDA event of a block's copies out (CPU copies are done at once):
    pending until the CPU synchronizes on it or the test declares every copy done."""

    def __init__(self, block: int, log: list, done: list):
        self.block, self.log, self.done, self.waited = block, log, done, False

    def query(self) -> bool:
        return self.waited or self.done[0]

    def synchronize(self) -> None:
        self.waited = True
        self.log.append(("wait out", self.block))


def _budget_run(layers, done_after_forward: bool):
    """A 4-block model offloading `layers` (None: all) with copies out that stay pending
    (`done_after_forward`: all done once the forward ends): the events of the forward
    (each block's start, waits for copies out) and backward (`reached`, restores, unpacks),
    each with the blocks in transit then; and whether the gradients equal the plain run's."""
    cfg = ModelConfig(**{**CFG.__dict__, "n_layer": 4})
    offload = ActivationOffload(torch.device("cpu"), layers)
    model = GPT2(cfg, offload=offload).train()
    plain = GPT2(cfg).train()
    init_parameters(plain, seed=0)
    model.load_state_dict(plain.state_dict())
    log, done, events = [], [False], []

    def pending_event(self):
        events.append(_PendingCopy(len(events), log, done))
        return events[-1]

    def note(kind, i):
        log.append((kind, i, offload.in_transit()))
        if kind == "restore":  # its restore waited (on the device) for its copies out
            events[i].waited = True

    for i, block in enumerate(model.transformer.h.values()):
        block.register_forward_pre_hook(lambda m, a, i=i: note("forward", i))
    saved, chain = activation_offload._SavedBlock, activation_offload.BlockChain
    restore, unpack, reached = saved.restore, saved.unpack, chain.reached
    with mock.patch.object(ActivationOffload, "_copied_out_event", pending_event), \
            mock.patch.object(saved, "restore", lambda self: (restore(self), note(
                "restore", self.index))[0]), \
            mock.patch.object(saved, "unpack", lambda self, h: (note("unpack", self.index),
                                                                unpack(self, h))[1]), \
            mock.patch.object(chain, "reached", lambda self, j: (note("reached", j),
                                                                  reached(self, j))[1]):
        loss = model(*_batch())
        done[0] = done_after_forward
        loss.backward()
    plain(*_batch()).backward()
    same = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                           plain.parameters()))
    return log, offload, same


def test_every_block_offloaded_stays_within_the_blocks_in_transit():
    """Every block offloaded, copies out slow (pending until waited for): before each
    block's forward the CPU waits for the oldest copy out so that at most IN_TRANSIT - 1
    are in flight (block j waits for block j - 2's); in the backward, restores and pending
    copies out never exceed IN_TRANSIT blocks, each block comes back once, last first, and
    the block before is restored while the current one runs its backward (depth 1). The
    gradients are the run's without offload."""
    log, offload, same = _budget_run(None, done_after_forward=False)
    assert same and offload.restored == 0
    n = activation_offload.IN_TRANSIT
    forwards = [e for e in log if e[0] == "forward"]
    assert all(t <= n - 1 for _, _, t in forwards), forwards
    for j in range(n, 4):  # block j's forward after the wait for block j - n's copy out
        assert log.index(("wait out", j - n)) < log.index(forwards[j])
    backward = log[_first(log, "reached", 3):]
    assert all(e[2] <= n for e in backward if e[0] in ("restore", "unpack"))
    assert [e[1] for e in backward if e[0] == "restore"] == [3, 2, 1, 0]
    for b in range(3):  # block b restored before block b + 1's backward is done
        assert _first(backward, "restore", b) < _first(backward, "reached", b)
        assert _first(backward, "unpack", b + 1) < _first(backward, "restore", b - 1) \
            if b else True  # ... and not more than one block ahead


def _first(log, kind, i) -> int:
    return next(n for n, e in enumerate(log) if e[:2] == (kind, i))


def test_first_blocks_offloaded_copy_under_the_later_blocks():
    """offload.activations_layers=2 of 4, copies out done by the end of the forward: the
    forward never waits (the 2 blocks kept on the device leave room), and both offloaded
    blocks are restored, last first, as soon as the backward reaches the chunk's last block
    — before the kept blocks' backward, within IN_TRANSIT — not when their own backward
    starts. The gradients are the run's without offload."""
    log, offload, same = _budget_run(2, done_after_forward=True)
    assert same and offload.waits_for_room == 0
    kinds = [e[:2] for e in log]
    assert [i for k, i in kinds if k == "restore"] == [1, 0]
    assert kinds.index(("reached", 3)) < kinds.index(("restore", 1)) < \
        kinds.index(("restore", 0)) < kinds.index(("reached", 2))
    assert all(t <= activation_offload.IN_TRANSIT for k, _, t in log if k == "restore")
