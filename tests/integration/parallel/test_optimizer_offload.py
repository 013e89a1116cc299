"""Optimizer offload (offload.optimizer = f): the fp32 master weights and AdamW moments of the
fraction f of each rank's owned range live in host memory and are stepped by the CPU AdamW;
training equals the serial run without offload under zero 1/2/3, tp2 + SP and pp2; bf16 and
fp16 track the run without offload; a skipped step (non-finite, fp16 overflow) changes
nothing; checkpoints move between offloaded and plain runs. On CPU host = device: the copies
are real copies between separate buffers (tests/unit/parallel/test_cuda_optimizer_offload.py covers pinned
memory, the side stream and the overlap order)."""
from __future__ import annotations

import pytest
import torch

from megalite.config.layout import Layout
from megalite.config.schema import load_config
from megalite.plan.memory import make_plan
from megalite.testing.spawn import run_ranks
from tests.conftest import TINY
from tests.layouts import (
    FP32_NO_DROPOUT,
    assert_equal,
    train_in_process,
    train_layouts,
)


def _run(tiny_data, *extra):
    return [f"data.dir={tiny_data}", "model.n_layer=4", "train.micro_batch_size=1",
            "train.global_batch_size=4", *extra]


# (zero stage, fraction) across layouts: zero 1 at 0.5 and 1, zero 2 at 0.5 and 1, zero 3 at
# 1; pp2 (interleaved, 2 chunks per stage, and not): the tied embedding's gradient is summed
# with its host part, under zero 2 (device and host parts in one all-reduce) and zero 1 (with
# overlap_param_gather: each bucket's gather launched after its copy)
LAYOUTS = [["zero=2", "offload.optimizer=1"], ["zero=3", "offload.optimizer=1"],
           ["tp=2", "sp=true", "zero=1", "offload.optimizer=1"],
           ["pp=2", "parallel.virtual_stages=2", "zero=2", "offload.optimizer=0.5"],
           ["pp=2", "zero=1", "offload.optimizer=0.5", "parallel.overlap_param_gather=true"]]


def _wire_bytes(step_comm: dict, group: str) -> float:
    return sum(v["wire_bytes"] for k, v in step_comm.items() if k.startswith(group + "/"))


@pytest.mark.distributed
def test_training_with_offload_equals_the_serial_run(tiny_data, tmp_path):
    """2 steps (fp32, dropout 0; 1 micro-batch per step on dp4, 2 on dp2: zero 2/3 copy
    every micro-batch's reduced gradient) under each of LAYOUTS on 4 ranks: losses, grad
    norms and every parameter after every step equal the serial run without offload (run in
    this process); every rank holds the plan's device and host bytes, and each group carries
    the plan's bytes per step (the tied embedding's offloaded part is all-reduced once)."""
    steps = 2
    serial = train_in_process(tmp_path / "serial", _run(tiny_data), steps=steps)
    runs = train_layouts(tmp_path / "par", 4, [_run(tiny_data, *lo) for lo in LAYOUTS],
                         steps=steps)
    for layout, ranks in zip(LAYOUTS, runs):
        assert_equal(serial, ranks)
        cfg = load_config(TINY + FP32_NO_DROPOUT + _run(tiny_data, *layout))
        plan = make_plan(cfg, Layout.from_config(cfg, 4, "cpu"))
        for res in ranks:  # the plan's device and host bytes are what the rank holds
            stage = plan.stages[res["coords"][1]]
            for kind, got in res["bytes"].items():
                assert got == pytest.approx(stage.bytes[kind], rel=0.01), (layout, kind)
            assert res["host_bytes"] == pytest.approx(stage.host["optimizer"], rel=0.01)
        for stage in plan.stages:  # the mean over a stage's ranks, as tests/*/*/test_plan.py
            mine = [r["step_comm"] for r in ranks if r["coords"][1] == stage.stage]
            for group in ("tp", "pp", "dp", "embedding"):
                got = sum(_wire_bytes(c, group) for c in mine) / len(mine)
                assert got == pytest.approx(stage.comm[group], rel=0.02, abs=64), \
                    (layout, stage.stage, group)


def _order_of_events(rank, world, tiny_data, run_dir):
    """Zero 0 at dp 1 (the GPU benchmark's layout), 2 micro-batches a step, several buckets,
    everything offloaded: three steps A, B, C recorded by hooks — every gradient's arrival
    (the engine's post-accumulate hook), each bucket's copy to the host being issued, the
    host updates on the worker (the last one held until the next forward has started), the
    step returning, the next forward's waits for each bucket's parameters — and the same
    steps without offload (losses, norms, parameters)."""
    import threading

    from megalite.config.layout import validate
    from megalite.config.schema import load_config
    from megalite.train.build import build_trainer
    from megalite.train.runtime import init_runtime

    def trainer_of(name, *extra):
        cfg = load_config(TINY + FP32_NO_DROPOUT + [
            f"data.dir={tiny_data}", "train.micro_batch_size=1", "train.global_batch_size=2",
            "parallel.bucket_mb=0.05", *extra])
        validate(cfg, world)
        return build_trainer(cfg, init_runtime(cfg), f"{run_dir}/{name}")

    trainer = trainer_of("offload", "offload.optimizer=1")
    engine, offload = trainer.engine, trainer.engine.offload
    index = {id(r.bucket): i for i, r in enumerate(offload.order)}  # forward order
    owner = {id(p): index[id(b)] for b in engine.buckets for p in b.params}
    events, gate, armed = [], [None], [False]
    on_grad, on_launched, issued = engine._on_grad, offload.on_launched, offload._issued
    engine._on_grad = lambda p: (events.append(("grad", owner[id(p)])), on_grad(p))[1]
    offload.on_launched = lambda b, *a: (events.append(("copy", index[id(b)])),
                                         on_launched(b, *a))[1]
    offload._issued = lambda r: (events.append(("wait", index[id(r.bucket)])), issued(r))[1]
    last = len(offload.order) - 1
    for i, r in enumerate(offload.order):
        def update(i=i, step=r.optimizer.step):
            events.append(("update", i, threading.current_thread().name))
            if i == last and gate[0] is not None:  # hold the last update until the next
                if not gate[0].wait(timeout=60):   # forward has started
                    events.append(("gate timed out",))
            step()
            events.append(("updated", i))
        r.optimizer.step = update
    def forward_started(module, args) -> None:
        events.append(("forward",))
        if gate[0] is not None:
            gate[0].set()

    trainer.model.chunks[0].sharding_units()[0].register_forward_pre_hook(forward_started)
    clip_and_step, train_step = engine.clip_and_step, trainer.schedule.train_step
    def step(*a, **k):
        if armed[0] and gate[0] is None:  # step B's: held until step C's forward
            gate[0] = threading.Event()
        out = clip_and_step(*a, **k)
        events.append(("step returned",))
        return out

    engine.clip_and_step = step
    trainer.schedule.train_step = lambda *a, **k: (train_step(*a, **k),
                                                   events.append(("backward ended",)))[0]
    losses = [trainer.train_step()]  # step A: AdamW's state exists
    trainer.engine.wait_for_params()
    events.clear()
    armed[0] = True
    losses += [trainer.train_step(), trainer.train_step()]  # B, C
    trainer.engine.wait_for_params()
    params = [p.detach().clone() for p in trainer.model.parameters()]
    plain = trainer_of("plain")
    plain_losses = [plain.train_step() for _ in range(3)]
    plain.engine.wait_for_params()
    return (events, len(offload.order), losses, params, plain_losses,
            [p.detach().clone() for p in plain.model.parameters()])


@pytest.mark.distributed
def test_gradients_leave_during_the_backward_and_the_host_step_leaves_the_thread(
        tiny_data, tmp_path):
    """On a spawned rank (zero 0, dp 1, offload.optimizer=1): each bucket's copy to the host
    is issued during the backward, right after that bucket's last gradient arrived (before
    the next bucket's first), not after it; the host updates run on the offload worker in
    forward order; the step returns, and the next forward waits for the first bucket and
    starts, while the last bucket's host update has not finished (it is held until that
    forward starts: a step that updated on the training thread would time out); the update
    of bucket i comes before the wait for bucket i + 1. The three steps equal the run
    without offload (losses, norms, every parameter)."""
    (events, n, losses, params, plain_losses, plain_params), = run_ranks(
        _order_of_events, 1, args=(tiny_data, str(tmp_path)), timeout_s=300)
    assert n >= 4 and ("gate timed out",) not in events
    at = {e: i for i, e in reversed(list(enumerate(events)))}  # first occurrence
    ended = events.index(("backward ended",))  # step B's backward
    backward = events[:ended]
    copies = [i for i, e in enumerate(backward) if e[0] == "copy"]
    assert sorted(backward[i][1] for i in copies) == list(range(n))  # each bucket once
    last_grad = max(i for i, e in enumerate(backward) if e[0] == "grad")
    assert sum(i < last_grad for i in copies) >= n - 1  # during the backward
    for i in copies:  # right after its own bucket's last gradient
        b = backward[i][1]
        assert backward[i - 1] == ("grad", b), (b, backward[i - 1])
        assert all(e != ("grad", b) for e in backward[i:])
    updates = [e for e in events if e[0] == "update"]
    assert [e[1] for e in updates] == list(range(n)) + list(range(n))  # steps B and C
    assert all(e[2].startswith("megalite-offload") for e in updates)
    returned = at[("step returned",)]  # step B's
    later = {e: returned + i for i, e in reversed(list(enumerate(events[returned:])))}
    done_last = at[("updated", n - 1)]
    assert returned < done_last
    assert later[("wait", 0)] < later[("forward",)] < done_last  # the next forward started
    for i in range(n - 1):
        assert at[("update", i, updates[i][2])] < later[("wait", i + 1)]
    for (loss, norm), (loss_p, norm_p) in zip(losses, plain_losses):
        assert loss == pytest.approx(loss_p, rel=1e-5) and norm == pytest.approx(norm_p,
                                                                                 rel=1e-5)
    for p, q in zip(params, plain_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _host_step_overlaps(rank, world, tiny_data, run_dir):
    """On each of 2 ranks, for zero 1 and 2 (with overlap_param_gather) and zero 3, offload
    0.5, several buckets, 2 micro-batches a step: three steps, the second's last host update
    (the range first used last) held until the forward of the unit before that range's first
    unit has run. A step that waited for it — in the step, or in a gather or prefetch queued
    before that forward — would hold it until the gate times out. Recorded in the second
    step: the device AdamW having been queued (on CPU its own `.item()`s run inside), every
    `.item()`, the host step being queued. And
    the same steps without offload (losses, norms, parameters)."""
    import threading

    from megalite.config.layout import validate
    from megalite.parallel.units import unit_buckets
    from megalite.train.build import build_trainer
    from megalite.train.runtime import init_runtime

    def trainer_of(name, *extra):
        cfg = load_config(TINY + FP32_NO_DROPOUT + [
            f"data.dir={tiny_data}", "train.micro_batch_size=1", "train.global_batch_size=4",
            "parallel.bucket_mb=0.05", *extra])
        validate(cfg, world)
        return build_trainer(cfg, init_runtime(cfg), f"{run_dir}/{name}")

    out = {}
    for zero in (1, 2, 3):
        layout = [f"zero={zero}"] + (["parallel.overlap_param_gather=true"] if zero < 3 else [])
        trainer = trainer_of(f"z{zero}", *layout, "offload.optimizer=0.5")
        engine, offload = trainer.engine, trainer.engine.offload
        last = offload.order[-1]
        units = unit_buckets(trainer.model.chunks, engine.buckets)
        first_use = next(i for i, (_, mine) in enumerate(units)
                         if any(b is last.bucket for b in mine))
        gate, armed, hold, events = threading.Event(), [False], [False], []
        units[first_use - 1][0].register_forward_hook(lambda *_: gate.set(), prepend=True)

        def held(step=last.optimizer.step):
            if hold[0]:
                hold[0] = False
                if not gate.wait(timeout=60):
                    events.append("gate timed out")
            step()
        last.optimizer.step = held
        clip_and_step = engine.clip_and_step

        def step_b(*a, **k):  # the second step's: held until the third step's forward
            if armed[0]:
                armed[0], hold[0] = False, True
                gate.clear()
            return clip_and_step(*a, **k)
        engine.clip_and_step = step_b
        device_step, host_step, item = engine.optimizer.step, offload.step, torch.Tensor.item
        engine.optimizer.step = lambda *a: (device_step(*a), events.append("device AdamW"))[0]
        offload.step = lambda *a: (events.append("host step"), host_step(*a))[1]
        torch.Tensor.item = lambda t: (events.append("item"), item(t))[1]
        try:
            losses = [trainer.train_step()]
            engine.wait_for_params()
            events.clear()
            armed[0] = True
            losses += [trainer.train_step(), trainer.train_step()]
            engine.wait_for_params()
        finally:
            torch.Tensor.item = item
        plain = trainer_of(f"plain{zero}", *layout)
        plain_losses = [plain.train_step() for _ in range(3)]
        plain.engine.wait_for_params()
        pairs = [(_masters(trainer), _masters(plain))]  # zero 3's parameters are freed
        if zero < 3:
            pairs += [(p.detach().clone(), q.detach().clone()) for p, q in
                      zip(trainer.model.parameters(), plain.model.parameters())]
        out[zero] = (first_use, events, losses, plain_losses, pairs)
    return out


def _masters(trainer) -> torch.Tensor:
    """The rank's fp32 master range, device and host pieces in flat order."""
    return torch.cat([p.detach().reshape(-1) for p, _, _ in trainer.engine.main_params])


@pytest.mark.distributed
def test_zero_1_2_3_return_from_the_step_before_the_host_step_ends(tiny_data, tmp_path):
    """On 2 ranks at zero 1 and 2 (overlap_param_gather) and zero 3, offload 0.5: the host
    update of the range used last is held until the forward before its first unit ran, and
    the steps go on (no wait for it in the step, nor in an earlier gather or prefetch); no
    `.item()` (a device sync) comes between the device AdamW being queued and the host step
    being queued; the three steps equal the run without offload (losses, norms, the fp32
    masters, every parameter at zero 1/2)."""
    for out in run_ranks(_host_step_overlaps, 2, args=(tiny_data, str(tmp_path)),
                         timeout_s=600):
        for zero, (first_use, events, losses, plain_losses, params) in out.items():
            assert first_use >= 1 and "gate timed out" not in events, (zero, events)
            device, host = events.index("device AdamW"), events.index("host step")
            assert device < host and "item" not in events[device:host], (zero, events)
            for (loss, norm), (loss_p, norm_p) in zip(losses, plain_losses):
                assert loss == pytest.approx(loss_p, rel=1e-5), zero
                assert norm == pytest.approx(norm_p, rel=1e-5), zero
            for p, q in params:
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
