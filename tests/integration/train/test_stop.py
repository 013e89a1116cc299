"""Stopping early and cleanly (train.max_minutes, train.exit_signal): every rank stops after
the same step with a checkpoint of it, and checkpoint.resume=auto continues from there."""
from __future__ import annotations

import os
import signal

import pytest

from megalite.checkpoint.resolve import complete_checkpoints
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

MAX_STEPS = 5


def _fit(rank, world, tiny_data, run_dir, extra, signal_rank=None, signal_after=None):
    """pp=2 run to MAX_STEPS; rank `signal_rank` sends itself SIGUSR1 after step
    `signal_after`. Returns the logged steps, the first step, and whether fit put the previous
    SIGUSR1 handler back."""
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "pp=2", f"train.max_steps={MAX_STEPS}", f"checkpoint.dir={run_dir}/ckpt",
        "checkpoint.resume=auto", *extra])
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    start = trainer.step
    step = trainer.train_step

    def train_step():
        out = step()
        if rank == signal_rank and trainer.step == signal_after:
            os.kill(os.getpid(), signal.SIGUSR1)
        return out

    trainer.train_step = train_step
    before = signal.getsignal(signal.SIGUSR1)
    records = trainer.fit()
    return {"steps": [r["step"] for r in records], "start": start,
            "handler_restored": signal.getsignal(signal.SIGUSR1) == before}


def _complete(run_dir):
    return [int(p.name[5:]) for p in complete_checkpoints(run_dir / "ckpt")]


@pytest.mark.distributed
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tiny_data, tmp_path):
    """Only rank 1 gets SIGUSR1, after step 2: both ranks finish step 2, save it, log it and
    return; the resumed run trains steps 3-5."""
    out = run_ranks(_fit, 2, args=(tiny_data, str(tmp_path), ["train.exit_signal=SIGUSR1"],
                                   1, 2), timeout_s=300)
    for res in out:
        assert res["steps"] == [1, 2] and res["handler_restored"], res
    assert _complete(tmp_path) == [2]
    resumed = run_ranks(_fit, 2, args=(tiny_data, str(tmp_path), []), timeout_s=300)
    for res in resumed:
        assert res["start"] == 2 and res["steps"] == [3, 4, 5], res
    assert _complete(tmp_path) == [2, 5]


@pytest.mark.distributed
def test_the_time_budget_stops_the_run_with_a_checkpoint(tiny_data, tmp_path):
    """train.max_minutes far below one step: every rank stops after step 1 with its
    checkpoint; without the budget the run resumes there and finishes."""
    out = run_ranks(_fit, 2, args=(tiny_data, str(tmp_path), ["train.max_minutes=1e-5"]),
                    timeout_s=300)
    assert all(res["steps"] == [1] for res in out), out
    assert _complete(tmp_path) == [1]
    resumed = run_ranks(_fit, 2, args=(tiny_data, str(tmp_path), []), timeout_s=300)
    assert all(res["start"] == 1 and res["steps"][-1] == MAX_STEPS for res in resumed)
