"""Where a step's time goes (megalite.train.timers), reported per phase for the slowest rank,
and Python's garbage collector run at fixed steps (megalite.train.gc_control)."""
from __future__ import annotations

import gc
import time

import pytest

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.metrics import wandb_row
from megalite.train.runtime import init_runtime
from megalite.train.timers import PHASES
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

DELAY_S = 0.3


def _slowed(rank, world, tiny_data, run_dir):
    """dp=2 zero=1, four steps logged two at a time; rank 1 takes DELAY_S longer in every
    gradient sync, rank 0 as much longer reading its data."""
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "zero=1", "train.max_steps=4", "log.every=2"])
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    if rank == 1:
        sync = trainer.engine.finish_grad_sync
        trainer.engine.finish_grad_sync = lambda: (time.sleep(DELAY_S), sync())
    else:
        read = trainer.batches.next_step
        trainer.batches.next_step = lambda *args: (time.sleep(DELAY_S), read(*args))[1]
    return trainer.fit()


@pytest.mark.distributed
def test_each_phase_is_reported_for_its_slowest_rank(tiny_data, tmp_path):
    """Rank 1's slow gradient sync and rank 0's slow data reading both show, on every rank's
    record, in their own phase; no phase is longer than the step. (The two delays overlap in
    time, each rank waiting in the other's, so the step is barely longer than one delay.)"""
    for records in run_ranks(_slowed, 2, args=(tiny_data, str(tmp_path)), timeout_s=300):
        assert [r["step"] for r in records] == [2, 4]
        for r in records:
            phases = r["step_phases_s"]
            assert set(phases) == set(PHASES)
            assert phases["data"] >= DELAY_S and phases["grad_sync"] >= DELAY_S
            assert phases["forward_backward"] > 0 and phases["optimizer"] > 0
            assert max(phases.values()) <= r["step_time_s"] * 1.01, r
            row = wandb_row(r)
            assert row["perf/phase/grad_sync_s"] == phases["grad_sync"]


def _collections(rank, world, tiny_data, run_dir, every):
    """Full (generation 2) collections during fit, by the step they ran after."""
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "pp=2", "train.max_steps=6", f"train.gc_every={every}"])
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    seen = []

    def on_gc(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(trainer.step)

    step = trainer.train_step

    def train_step():
        assert not gc.isenabled()  # automatic collection is off while training
        return step()

    trainer.train_step = train_step
    gc.callbacks.append(on_gc)
    try:
        trainer.fit()
    finally:
        gc.callbacks.remove(on_gc)
    return {"collected_after": seen, "enabled_after": gc.isenabled()}


@pytest.mark.distributed
def test_scheduled_gc_collects_after_the_same_steps_on_every_rank(tiny_data, tmp_path):
    out = run_ranks(_collections, 2, args=(tiny_data, str(tmp_path), 2), timeout_s=300)
    for res in out:  # once at the start, then after steps 2, 4 and 6
        assert res == {"collected_after": [0, 2, 4, 6], "enabled_after": True}, res
