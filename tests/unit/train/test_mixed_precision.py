"""Mixed precision on real ranks: bf16 / fp16 parameters and activations with fp32 master
weights, gradients and moments (the CUDA default, here run on CPU), and fp16 loss scaling.

Reduced precision rounds differently in every layout, so a parallel run is compared with the
serial run of the same precision within tolerances far below what a lost, doubled or unscaled
gradient would cause (fp32 layouts are compared exactly-ish in the other test files). What
holds exactly in any precision: DP replicas are bitwise identical, and every parameter is its
fp32 master weight cast down.
"""
from __future__ import annotations

import pytest
import torch

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.train.build import build_trainer
from megalite.train.loss_scale import LossScaler
from megalite.train.metrics import wandb_row
from megalite.train.runtime import init_runtime
from megalite.train.step_guard import NonFiniteError
from megalite.train.trainer import Trainer
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

# lr without warmup, so that six steps move the weights far more than rounding does
LEARNING = ["train.micro_batch_size=2", "train.global_batch_size=8", "optim.lr=1e-2",
            "optim.warmup_steps=0"]


def _trainer(tiny_data, run_dir, *extra) -> Trainer:
    cfg = load_config(TINY + FP32_NO_DROPOUT + [f"data.dir={tiny_data}", "precision=fp16",
                                                *LEARNING, *extra])
    validate(cfg, 1)
    return build_trainer(cfg, init_runtime(cfg), run_dir)


def test_loss_scaler_rules():
    """Dynamic: halve after `hysteresis` overflows (never below the floor), double after
    `window` clean steps; an overflow is the scale's to absorb only above the floor."""
    s = LossScaler(scale=8.0, min_scale=2.0, window=3, hysteresis=2, hysteresis_left=2)
    assert s.update(overflow=True) and s.scale == 8.0  # first overflow: hysteresis
    assert s.update(overflow=True) and s.scale == 4.0
    assert s.update(overflow=True) and s.scale == 2.0  # hysteresis spent: halves at once
    assert not s.update(overflow=True) and s.scale == 2.0  # the floor: not absorbed
    for _ in range(2):
        assert not s.update(overflow=False) and s.scale == 2.0
    s.update(overflow=False)
    assert (s.scale, s.good_steps, s.hysteresis_left) == (4.0, 0, 2)  # grew, hysteresis reset
    state = s.state_dict()
    again = LossScaler(scale=1.0, min_scale=2.0, window=3)
    again.load_state_dict(state)
    assert again.state_dict() == state
    fixed = LossScaler(scale=128.0, dynamic=False)
    assert not fixed.update(overflow=True) and fixed.scale == 128.0
    fixed.load_state_dict(state)  # a static scale is the config's
    assert fixed.scale == 128.0


@pytest.mark.slow
def test_overflowing_scale_is_lowered_skipping_steps_and_then_grows(tiny_data, tmp_path):
    """A scale too large for fp16 (2^24 here: some scaled gradient is inf) skips steps,
    leaving the weights untouched, halving each time, without counting towards
    train.max_bad_steps; once the gradients are finite training proceeds and the scale
    doubles after every `window` clean steps."""
    trainer = _trainer(tiny_data, tmp_path / "a", "loss_scale.initial=16777216",
                       "loss_scale.hysteresis=1", "loss_scale.window=3", "train.max_bad_steps=2")
    scales, losses = [], []
    for _ in range(20):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        scales.append(trainer.loss_scaler.scale)
        loss, _ = trainer.train_step()
        losses.append(loss)
        after = list(trainer.model.parameters())
        assert (loss is None) == all(torch.equal(a, b) for a, b in zip(after, before))
    skipped = [i for i, loss in enumerate(losses) if loss is None]
    assert len(skipped) >= 3 and trainer.skipped_steps == len(skipped)
    first_good = losses.index(next(loss for loss in losses if loss is not None))
    assert skipped[:first_good] == list(range(first_good))  # the first steps all overflowed
    assert scales[:first_good + 1] == [2.0 ** (24 - i) for i in range(first_good + 1)]
    replay = LossScaler(scale=2.0 ** 24, window=3, hysteresis=1, hysteresis_left=1)
    for scale, loss in zip(scales, losses):  # every later move follows the rules
        assert replay.scale == scale
        replay.update(overflow=loss is None)
    assert max(scales[first_good:]) > scales[first_good]  # it grew again
    trained = [loss for loss in losses if loss is not None]
    assert trained[-1] < trained[0] - 0.5
    trainer.cfg.train.max_steps = trainer.step + 1
    (record,) = trainer.fit()
    assert record["loss_scale"] == trainer.loss_scaler.scale
    assert wandb_row(record)["train/loss_scale"] == trainer.loss_scaler.scale


@pytest.mark.parametrize("setting,message", [
    (["loss_scale.static=1099511627776"], "at the static loss_scale.static=1.09951e\\+12"),
    (["loss_scale.initial=1099511627776", "loss_scale.min=1099511627776"],
     "at the dynamic loss scale's floor loss_scale.min=1.09951e\\+12"),
])
def test_overflow_at_a_scale_that_cannot_drop_stops_the_run(tiny_data, tmp_path, setting,
                                                            message):
    trainer = _trainer(tiny_data, tmp_path / "a", "train.max_bad_steps=3", *setting)
    with pytest.raises(NonFiniteError, match=f"3 steps in a row .*{message}"):
        for _ in range(5):
            trainer.train_step()
    assert trainer.step == 3


@pytest.mark.slow
def test_resume_continues_the_loss_scale_exactly(tiny_data, tmp_path):
    """The dynamic scale's state is in the checkpoint: a run resumed at step 4 continues with
    the same scales, losses and weights, bit for bit, as the run that went on."""
    common = ("loss_scale.initial=4096", "loss_scale.window=2", "loss_scale.hysteresis=1",
              "train.max_steps=8", f"checkpoint.dir={tmp_path / 'ckpt'}")
    straight = _trainer(tiny_data, tmp_path / "a", *common)
    seen = []
    for _ in range(8):
        seen.append((straight.train_step()[0], straight.loss_scaler.state_dict()))
        if straight.step == 4:
            saved = straight.save()
    assert seen[3][1]["scale"] != 4096.0  # it moved before the save
    resumed = _trainer(tiny_data, tmp_path / "b", *common, f"checkpoint.resume={saved}")
    assert resumed.loss_scaler.state_dict() == seen[3][1]
    for expected in seen[4:]:
        assert (resumed.train_step()[0], resumed.loss_scaler.state_dict()) == expected
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
