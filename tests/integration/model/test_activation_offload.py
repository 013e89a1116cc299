"""Activation offload (offload.activations): the saved tensors of the offloaded blocks go to
host memory and come back, parameters never move, training equals the run without it (alone,
with partial recompute, under pp2 with several micro-batches in flight, tp2 + SP, interleaved
zero 3), and the plan's host bytes are what the hooks held. On CPU host = device: the same
code path runs (tests/unit/model/test_cuda_offload.py covers pinned memory and the side stream)."""
from __future__ import annotations

import pytest

from megalite.config.layout import Layout
from megalite.config.schema import load_config
from megalite.plan.memory import make_plan
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT, assert_equal, train_layouts


def _run(tiny_data, *extra):
    return [f"data.dir={tiny_data}", "model.n_layer=4", "train.micro_batch_size=1",
            "train.global_batch_size=4", *extra]


OFFLOAD = ["offload.activations=true"]
RECOMPUTE_1 = ["train.recompute=true", "train.recompute_layers=1"]


@pytest.mark.distributed
def test_training_with_offload_equals_the_run_without(tiny_data, tmp_path):
    """3 steps (fp32, dropout 0): the serial run with offload, and with offload after one
    recomputed block; pp2 x tp2 + SP (4 micro-batches, 2 in flight on stage 0) offloading
    the block after the recomputed one; pp2 x dp2 interleaved (2 chunks per stage) under
    zero 3 — losses, grad norms and every parameter after every step equal the serial run
    without offload. The most host bytes the hooks held in each step is the plan's host
    figure for the rank's stage (within 1%)."""
    steps = 3
    serial = [_run(tiny_data), _run(tiny_data, *OFFLOAD), _run(tiny_data, *OFFLOAD, *RECOMPUTE_1)]
    parallel = [_run(tiny_data, "pp=2", "tp=2", "sp=true", *OFFLOAD, *RECOMPUTE_1),
                _run(tiny_data, "pp=2", "zero=3", "parallel.virtual_stages=2", *OFFLOAD)]
    serial_runs = train_layouts(tmp_path / "serial", 1, serial, steps=steps)
    parallel_runs = train_layouts(tmp_path / "parallel", 4, parallel, steps=steps)
    reference = serial_runs[0][0]
    assert reference["offload_peaks"] == [None] * steps
    for world, overrides, ranks in [(1, serial[1], serial_runs[1]), (1, serial[2], serial_runs[2]),
                                    (4, parallel[0], parallel_runs[0]),
                                    (4, parallel[1], parallel_runs[1])]:
        assert_equal(reference, ranks)
        cfg = load_config(TINY + FP32_NO_DROPOUT + overrides)
        plan = make_plan(cfg, Layout.from_config(cfg, world, "cpu"))
        for res in ranks:
            want = plan.stages[res["coords"][1]].host["total"]
            assert want > 0
            for held in res["offload_peaks"]:
                assert held == pytest.approx(want, rel=0.01), (overrides, res["coords"])
