"""Optimizer offload (offload.optimizer = f): the fp32 master weights and AdamW moments of the
fraction f of each rank's owned range live in host memory and are stepped by the CPU AdamW;
training equals the serial run without offload under zero 1/2/3, tp2 + SP and pp2; bf16 and
fp16 track the run without offload; a skipped step (non-finite, fp16 overflow) changes
nothing; checkpoints move between offloaded and plain runs. On CPU host = device: the copies
are real copies between separate buffers (tests/unit/parallel/test_cuda_optimizer_offload.py covers pinned
memory, the side stream and the overlap order)."""
from __future__ import annotations

import math
import threading
from dataclasses import replace

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.layout import Layout, validate
from megalite.config.schema import load_config
from megalite.parallel import host_range
from megalite.parallel.norms import squares_fp32_rows, squares_fp64
from megalite.plan.devices import device_profile
from megalite.plan.fit import cheapest_fit
from megalite.plan.memory import make_plan
from megalite.plan.time_model import predict
from megalite.train.build import build_trainer
from megalite.train.host_memory import check_host_memory
from megalite.train.host_threads import host_threads_per_rank, set_host_threads
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import (
    FP32_NO_DROPOUT,
    _parameters_are_masters_cast,
)


def _trainer(tiny_data, run_dir, *extra):
    """One rank, 2 blocks, 1 micro-batch per step (zero 0 copies the gradient once a step)."""
    cfg = load_config(TINY + FP32_NO_DROPOUT + [f"data.dir={tiny_data}",
                                                "train.micro_batch_size=2",
                                                "train.global_batch_size=2", *extra])
    validate(cfg, 1)
    return build_trainer(cfg, init_runtime(cfg), run_dir)


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_fraction_outside_0_1_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"offload\.optimizer="):
        validate(load_config(TINY + [f"offload.optimizer={value}"]), 1)


def test_cpu_offload_says_it_saves_nothing():
    warnings = validate(load_config(TINY + ["offload.optimizer=0.5"]), 1)
    assert any("offload.optimizer=0.5 on CPU" in w and "saves nothing" in w for w in warnings)


def test_plan_places_the_fraction_on_the_host():
    """zero 2, bf16, dp 8: O and G shrink by the fraction, the host holds master + moments
    + gradient + copy staging + the bf16 cast buffer; PCIe per step: m gradient copies in,
    the bf16 parameters out."""
    base = ["model=gpt2-xl", "zero=2", "train.seq_len=1024", "train.micro_batch_size=4",
            "train.global_batch_size=128"]
    plans = [make_plan(c, Layout.from_config(c, 8, "cuda")) for c in (
        load_config(base), load_config(base + ["offload.optimizer=0.5"]))]
    off, on = plans[0].stages[0], plans[1].stages[0]
    owned = off.params / 8
    assert on.bytes["optimizer"] == pytest.approx(off.bytes["optimizer"] / 2)
    assert on.bytes["grads"] == pytest.approx(off.bytes["grads"] / 2)
    assert on.host["optimizer"] == pytest.approx((16 + 4 + 2) * owned / 2)
    m = 4
    assert on.pcie["d2h"] == pytest.approx(4 * owned / 2 * m)
    assert on.pcie["h2d"] == pytest.approx(2 * owned / 2)
    assert "offloaded (50% of the owned range: fp32 master weights and moments) to host " \
        "memory" in plans[1].placement["O"]
    assert "PCIe GB" in plans[1].table() and "PCIe" not in plans[0].table()


def test_cheapest_fit_names_the_cheapest_placement_that_fits():
    """gpt2-xl on one 12 GiB device: only offloading all of the optimizer state fits (one
    rank: no ZeRO; recompute frees activations, not the 18 GiB of state); at 20 GiB the
    cheapest mix depends on the rates, which are the time model's on the profile given (free
    copies and host AdamW: offload alone); at 80 GiB it fits as it is; at 6 GiB nothing
    does."""
    cfg = load_config(["model=gpt2-xl", "train.seq_len=1024", "train.micro_batch_size=1",
                       "train.global_batch_size=8"])
    layout = Layout.from_config(cfg, 1, "cuda")
    gib, h100 = 2**30, device_profile("h100-80gb")
    assert cheapest_fit(cfg, layout, 80 * gib, h100).overrides == ()
    assert cheapest_fit(cfg, layout, 6 * gib, h100) is None
    fit = cheapest_fit(cfg, layout, 12 * gib, h100)
    assert fit.overrides == ("offload.optimizer=1",) and fit.device_bytes <= 12 * gib
    changed = load_config(["model=gpt2-xl", "train.seq_len=1024", "train.micro_batch_size=1",
                           "train.global_batch_size=8", *fit.overrides])
    assert make_plan(changed, layout).peak.bytes["total"] == fit.device_bytes
    # the added time is the time model's difference of the two predicted steps
    plan = make_plan(changed, layout)
    assert fit.added_s == pytest.approx(
        predict(changed, layout, plan.stages, h100, 1).step_s
        - predict(cfg, layout, make_plan(cfg, layout).stages, h100, 1).step_s)
    free = replace(h100, h2d_gbps=1e9, d2h_gbps=1e9, host_adam_params_per_s=1e18)
    assert cheapest_fit(cfg, layout, 20 * gib, free).overrides[0].startswith("offload.")
    mixed = cheapest_fit(cfg, layout, 20 * gib, h100)
    assert mixed.device_bytes <= 20 * gib and mixed.added_s > 0


def test_not_enough_host_memory_counts_every_local_rank_and_the_staging():
    cfg = load_config(["model=gpt2-xl", "zero=1", "offload.optimizer=1", "train.seq_len=1024",
                       "train.micro_batch_size=4", "train.global_batch_size=64",
                       "checkpoint.async_save=true"])
    layout = Layout.from_config(cfg, 8, "cuda")
    stage = make_plan(cfg, layout).stages[0]
    per_rank = stage.host["total"] + 12 * stage.params / 8
    check_host_memory(cfg, layout, 8, available=int(8 * per_rank) + 1)  # fits
    with pytest.raises(ConfigError, match=r"offload\.optimizer=1") as e:
        check_host_memory(cfg, layout, 8, available=int(8 * per_rank) - 2**30)
    need, have = f"{8 * per_rank / 2**30:.2f} GiB", f"{(8 * per_rank - 2**30) / 2**30:.2f} GiB"
    assert need in str(e.value) and have in str(e.value) and "staging" in str(e.value)


def test_host_threads_take_the_ranks_share_of_the_cores(monkeypatch):
    """offload.optimizer on CUDA: cores // LOCAL_WORLD_SIZE threads (torchrun's 1 raised,
    never lowered); nothing changes without offload or on CPU."""
    assert host_threads_per_rank(64, 8, current=1) == 8
    assert host_threads_per_rank(2, 4, current=1) == 1
    assert host_threads_per_rank(64, 8, current=16) == 16
    calls = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    cuda = torch.device("cuda")
    assert set_host_threads(0.5, torch.device("cpu"), local_ranks=8, cores=64) is None
    assert set_host_threads(0.0, cuda, local_ranks=8, cores=64) is None
    assert calls == []
    assert set_host_threads(0.5, cuda, local_ranks=8, cores=64) == 8 and calls == [8]


def test_host_norm_is_fp32_rows_summed_in_fp64():
    """The host pieces' squares: fp32 norms of 1024-element rows, summed in fp64, equal the
    fp64 norm to ~1e-8 where one fp32 norm over the piece is ~1e-4 off (2M elements)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2_000_000, generator=g) * 1e-3
    x[::7] *= 50
    pieces = [x[:5], x[5:1_500_000], x[1_500_000:]]  # a short one, tails of every length
    want = squares_fp64(pieces, torch.device("cpu")).item()
    got = squares_fp32_rows(pieces, torch.device("cpu")).item()
    whole = float(torch.linalg.vector_norm(x)) ** 2
    assert abs(got / want - 1) < 1e-7 < abs(whole / want - 1)


@pytest.mark.parametrize("device, bound", [(torch.device("cuda", 1), 1),
                                           (torch.device("cpu"), None)])
def test_the_offload_worker_thread_works_on_the_engines_cuda_device(monkeypatch, device, bound):
    """The worker thread binds the engine's CUDA device before its first task (its event
    syncs and stream switches would otherwise make a context on GPU 0, as the hang watch's
    thread avoids): `torch.cuda.set_device` (patched: no GPU here) is called on the worker
    thread, with the engine's device index, before any task runs; on CPU never."""
    from megalite.parallel.offload_worker import HostWorker

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda index: calls.append((index, threading.current_thread().name)))
    host = HostWorker(device)
    seen, worker = host.submit(lambda: (list(calls), threading.current_thread().name)).result()
    host.close()
    assert worker.startswith("megalite-offload") and host._executor is None
    assert seen == ([] if bound is None else [(bound, worker)])


def test_a_failed_host_update_raises_before_its_parameters_are_read(tiny_data, tmp_path):
    """The last bucket's host AdamW raises (patched on the rank): the step that queued it
    returns (it does not wait for the host step); the next step raises that error before
    reading the bucket, and so does reading the host state for a checkpoint."""
    trainer = _trainer(tiny_data, tmp_path / "a", "offload.optimizer=1")
    assert trainer.train_step()[0] is not None
    trainer.engine.offload.step_done()  # that step's host updates ran
    last = trainer.engine.offload.order[-1]

    def broken():
        raise RuntimeError("host AdamW failed")

    last.optimizer.step = broken
    trainer.train_step()  # queued the failing update and returned
    with pytest.raises(RuntimeError, match="host AdamW failed"):
        trainer.engine.main_params
    with pytest.raises(RuntimeError, match="host AdamW failed"):
        trainer.train_step()


def test_the_fraction_of_every_owned_range_lives_in_separate_host_buffers(tiny_data, tmp_path):
    """Each bucket's last half is offloaded into tensors of its own (the copies are real, also
    on CPU); a non-finite gradient in a host piece (patched into the device gradient's host
    part as the reduction launches, so the copy carries it and the worker's squares see it)
    skips the step: the host masters and moments, the device masters and the parameters
    stay as they were."""
    trainer = _trainer(tiny_data, tmp_path / "a", "offload.optimizer=0.5",
                       "train.max_bad_steps=3")
    engine = trainer.engine
    offload = engine.offload
    assert engine.optimizer is not None and len(engine.optimizers) > 1
    for b in engine.buckets:
        r = offload.range_of(b)
        assert r.main.numel() == round(0.5 * (b.hi - b.lo)) == b.hi - r.cut
        assert r.main.untyped_storage().data_ptr() != b.param_region.untyped_storage().data_ptr()
        torch.testing.assert_close(r.main, b.param_region[r.offset:], rtol=0, atol=0)
    host = sum(r.main.numel() for r in offload.ranges.values())
    assert engine.host_state_bytes() == 16 * host  # master, 2 moments, gradient (fp32)
    assert trainer.train_step()[0] is not None  # the moments exist
    # metrics: host bytes; PCIe per step: zero 0 copies the gradient in once, fp32 params out
    assert trainer._offload_memory(steps=1) == {
        "optimizer_offload_host_bytes": 16 * host, "optimizer_offload_pcie_bytes": 8 * host}
    r = offload.order[0]
    before = _state(trainer)

    def poison(bucket, grad):
        if bucket is r.bucket:
            grad[r.cut] = float("nan")  # the first element of the host part

    engine.grad_launching.append(poison)
    loss, norm = trainer.train_step()
    assert loss is None and math.isnan(norm) and trainer.skipped_steps == 1
    for a, b in zip(before, _state(trainer)):
        assert torch.equal(a, b)


def _state(trainer) -> list:
    """Every master piece (host and device) with its AdamW state, and every parameter."""
    engine = trainer.engine
    engine.wait_for_params()  # offload: the host step may still run when train_step returns
    return [t.clone() for p, _, _ in engine.main_params
            for t in [p.detach(), *engine.adam_state(p).values()]] + \
        [p.detach().clone() for p in trainer.model.parameters()]


def _steps(trainer, steps):
    out = []
    for _ in range(steps):
        loss, norm = trainer.train_step()
        trainer.engine.wait_for_params()  # offload: the host step may still be running
        out.append((loss, norm, [p.detach().clone() for p in trainer.model.parameters()]))
    return out


def test_checkpoints_move_between_offloaded_and_plain_runs(tiny_data, tmp_path, monkeypatch):
    """An offloaded zero 2 run (0.5) saves at step 1, a plain run resumes it and saves at
    step 2, a fully offloaded run resumes that: steps 2 and 3 equal the plain run's without
    checkpoints (the format is the same: only where the state lived differs). 2 micro-batches
    a step: zero 2 copies each reduced gradient to the host and sums them there, on the fold
    thread, not the training thread."""
    folds = []
    fold = host_range.fold
    monkeypatch.setattr(host_range, "fold", lambda *a: (
        folds.append(threading.current_thread().name), fold(*a))[1])
    two = ["train.global_batch_size=4"]
    reference = _steps(_trainer(tiny_data, tmp_path / "ref", *two), 3)
    chain, ckpt = [], tmp_path / "ckpt"
    for i, (extra, steps) in enumerate([(["offload.optimizer=0.5", "zero=2"], 1), ([], 1),
                                        (["offload.optimizer=1"], 1)]):
        resume = [] if i == 0 else ["checkpoint.resume=auto"]
        trainer = _trainer(tiny_data, tmp_path / str(i), f"checkpoint.dir={ckpt}",
                           *resume, *two, *extra)
        assert trainer.step == i
        chain += _steps(trainer, steps)
        trainer.save()
        if i == 0:
            assert len(folds) == 2 * len(trainer.engine.offload.ranges)
            assert all(name.startswith("megalite-offload") for name in folds)
    for (loss, norm, params), (loss_r, norm_r, params_r) in zip(chain, reference):
        assert math.isclose(loss, loss_r, rel_tol=1e-5) and math.isclose(norm, norm_r,
                                                                         rel_tol=1e-5)
        for p, q in zip(params, params_r):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# fp16: from 2^15 the scale doubles after every clean step (window 1) until a step overflows
# (at 2^18, step 4, in these runs) and is skipped, once AdamW's moments exist
MIXED = {"bf16": [], "fp16": ["loss_scale.initial=32768", "loss_scale.window=1",
                              "loss_scale.hysteresis=1"]}


@pytest.mark.parametrize("precision", sorted(MIXED))
def test_mixed_precision_with_offload_tracks_the_plain_run(tiny_data, tmp_path, precision):
    """bf16 / fp16 parameters, fp32 masters and moments on the host (cast to the model dtype
    there before the copy back): 6 steps track the plain run within
    tests/*/*/test_mixed_precision.py's tolerances, and every parameter is its fp32 master cast
    down. fp16 (loss scaling, the host gradients unscaled with the device's): a step that
    overflows is skipped in both runs alike and changes neither host nor device state."""
    extra = [f"precision={precision}", "optim.lr=1e-2", "optim.warmup_steps=0",
             *MIXED[precision]]
    runs, unchanged = [], []
    for offload in ([], ["offload.optimizer=0.5"]):
        trainer = _trainer(tiny_data, tmp_path / str(len(runs)), *extra, *offload)
        out = []
        for _ in range(6):
            before = _state(trainer)
            out += _steps(trainer, 1)
            if out[-1][0] is None:
                unchanged.append(all(torch.equal(a, b) for a, b in zip(before,
                                                                       _state(trainer))))
        runs.append(out)
        assert _parameters_are_masters_cast(trainer.engine)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        assert all(p.dtype == dtype for p in trainer.model.parameters())
    plain, offloaded = runs
    assert [loss is None for loss, _, _ in plain] == [loss is None for loss, _, _ in offloaded]
    if precision == "fp16":  # a skipped step after AdamW stepped, seen by both runs
        assert plain[0][0] is not None and len(unchanged) >= 2 and all(unchanged)
    trained = [loss for loss, _, _ in plain if loss is not None]
    assert trained[-1] < trained[0] - 0.5  # it learns
    for (loss, norm, params), (loss_p, norm_p, params_p) in zip(offloaded, plain):
        if loss_p is not None:
            assert math.isclose(loss, loss_p, rel_tol=3e-3) and math.isclose(norm, norm_p,
                                                                             rel_tol=5e-2)
    moved = sum(float((q.float() - p.float()).square().sum())
                for p, q in zip(plain[0][2], plain[-1][2]))
    err = sum(float((q.float() - p.float()).square().sum())
              for p, q in zip(offloaded[-1][2], plain[-1][2]))
    assert math.sqrt(err / moved) < 0.25  # a lost or doubled update is of order 1
