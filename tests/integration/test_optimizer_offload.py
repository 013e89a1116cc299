"""Optimizer offload (offload.optimizer = f): the fp32 master weights and AdamW moments of the
fraction f of each rank's owned range live in host memory and are stepped by the CPU AdamW;
training equals the serial run without offload under zero 1/2/3, tp2 + SP and pp2; bf16 and
fp16 track the run without offload; a skipped step (non-finite, fp16 overflow) changes
nothing; checkpoints move between offloaded and plain runs. On CPU host = device: the copies
are real copies between separate buffers (tests/unit/test_cuda_optimizer_offload.py covers pinned
memory, the side stream and the overlap order)."""
from __future__ import annotations

import pytest

from megalite.config.layout import Layout
from megalite.config.schema import load_config
from megalite.plan.memory import make_plan
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
        for stage in plan.stages:  # the mean over a stage's ranks, as tests/*/test_plan.py
            mine = [r["step_comm"] for r in ranks if r["coords"][1] == stage.stage]
            for group in ("tp", "pp", "dp", "embedding"):
                got = sum(_wire_bytes(c, group) for c in mine) / len(mine)
                assert got == pytest.approx(stage.comm[group], rel=0.02, abs=64), \
                    (layout, stage.stage, group)
