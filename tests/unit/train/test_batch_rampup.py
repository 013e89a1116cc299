"""Batch-size ramp-up (train.rampup_batch_size, Megatron's --rampup-batch-size): the global
batch grows with the samples consumed; every layout trains the same steps as the serial run,
also when resumed mid-ramp under another layout."""
from __future__ import annotations

import pytest

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.train.batch_size import BatchSizeSchedule
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

RAMP = ["train.micro_batch_size=2", "train.global_batch_size=16",
        "train.rampup_batch_size=[4,4,24]"]
# 3 increments of 4 over 24 samples, one every 8: consumed 0, 4 -> 4; 8 -> 8; 16 -> 12; then 16
SIZES = [4, 4, 8, 12, 16, 16]


def test_schedule_follows_megatrons_formula():
    ramp = BatchSizeSchedule(16, (4, 4, 24))
    consumed, sizes = 0, []
    for _ in range(6):
        sizes.append(ramp.at(consumed))
        consumed += sizes[-1]
    assert sizes == SIZES
    assert BatchSizeSchedule(16).at(0) == 16
    ramp = BatchSizeSchedule(64, (8, 8, 700))  # 7 increments, one every 100 samples
    assert [ramp.at(c) for c in (0, 99, 100, 699, 700, 10**6)] == [8, 8, 16, 56, 64, 64]


@pytest.mark.slow
def test_logged_batch_sizes_and_tokens(tiny_data, tmp_path):
    cfg = load_config(TINY + FP32_NO_DROPOUT + [f"data.dir={tiny_data}", *RAMP,
                                                "train.max_steps=6"])
    validate(cfg, 1)
    records = build_trainer(cfg, init_runtime(cfg), tmp_path).fit()
    assert [r["global_batch_size"] for r in records] == SIZES
    consumed = [sum(SIZES[:i + 1]) * cfg.train.seq_len for i in range(6)]
    assert [r["consumed_tokens"] for r in records] == consumed
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(
            r["global_batch_size"] * cfg.train.seq_len / r["step_time_s"])


@pytest.mark.parametrize("overrides,world,expect", [
    (["train.rampup_batch_size=[4,4]"], 1, "three positive integers"),
    (["train.rampup_batch_size=[32,8,100]"], 1, "start must be below"),
    (["train.rampup_batch_size=[8,5,100]"], 1, "whole increments"),
    (["train.rampup_batch_size=[8,8,100]"], 2, "multiples of micro_batch_size*dp = 16"),
    (["pp=2", "parallel.virtual_stages=2", "model.n_layer=4",
      "train.rampup_batch_size=[8,8,100]"], 2,
     "m = start/(micro_batch_size*dp) = 1 micro-batches must be >= pp=2"),
])
def test_bad_ramps_are_refused(overrides, world, expect):
    cfg = load_config(TINY + ["train.micro_batch_size=8", "train.global_batch_size=32",
                              *overrides])
    with pytest.raises(ConfigError, match=r"train.rampup_batch_size=\[") as e:
        validate(cfg, world)
    assert expect in str(e.value)
