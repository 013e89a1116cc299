"""parallel.rank_order=tp-cp-dp-pp (Megatron's: PP outermost, a stage's ranks consecutive)
equals the serial run (fp32, rel 1e-5: losses, grad norms, every parameter; the MoE figures)
under the collective-order probe, for a dense pp2·dp2 ZeRO-1 run and a Mixtral at ep2·pp2
(EP folded over each stage's two DP ranks, which this order makes ranks 0-1 and 2-3). Each
run's checkpoint after step 1 resumes in the other order (tp-cp-pp-dp) and continues the serial
run: checkpoints are layout-independent, and a rank's per-rank files are read only in the
order that wrote them."""
from __future__ import annotations

import pytest

from megalite.testing.collective_order import order_mismatches
from tests.conftest import serial_common
from tests.integration.model.test_moe_layouts import MOE, assert_figures_equal
from tests.layouts import Later, assert_equal, from_step, train_in_process, train_layouts

pytestmark = pytest.mark.distributed

STEPS = 3
DEEP = ["model.n_layer=4"]  # 2 blocks a stage; micro-batches of 2, 2 a replica at dp 2
MEGATRON, DEFAULT = "parallel.rank_order=tp-cp-dp-pp", "parallel.rank_order=tp-cp-pp-dp"


def test_megatron_rank_order_equals_serial_and_resumes_in_the_default_order(
        tiny_data, tmp_path):
    common = serial_common(tiny_data)
    dense, moe = common + DEEP, common + DEEP + MOE
    serial = {name: train_in_process(tmp_path / f"serial-{name}", run, STEPS)
              for name, run in (("dense", dense), ("moe", moe))}
    ckpt = {name: tmp_path / f"ckpt-{name}" for name in serial}
    runs = [dense + ["pp=2", "zero=1", MEGATRON, f"checkpoint.dir={ckpt['dense']}"],
            moe + ["pp=2", "ep=2", "zero=1", MEGATRON, f"checkpoint.dir={ckpt['moe']}"],
            Later(dense + ["pp=2", "zero=1", DEFAULT,
                           f"checkpoint.resume={ckpt['dense'] / 'step_00000001'}"], STEPS - 1),
            Later(moe + ["pp=2", "ep=2", "zero=1", DEFAULT,
                         f"checkpoint.resume={ckpt['moe'] / 'step_00000001'}"], STEPS - 1)]
    results = train_layouts(tmp_path / "runs", 4, runs, STEPS, save_at=1, probe=True)
    for i, name in enumerate(("dense", "moe")):
        ours, resumed = results[i], results[i + 2]
        # (tp, pp, dp) of ranks 0-3: dp innermost under tp-cp-dp-pp, pp under tp-cp-pp-dp
        assert [r["coords"] for r in ours] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
        assert [r["coords"] for r in resumed] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
        if name == "moe":  # ranks 0-1 hold experts 0-1 and 2-3 of stage 0
            assert [r["ep_rank"] for r in ours] == [0, 1, 0, 1]
        reference = serial[name]
        assert_equal(reference, ours)
        expected = {**from_step(reference, 1), "moe": reference["moe"][1:]}
        assert_equal(expected, resumed)
        if name == "moe":
            assert_figures_equal(reference, ours)
            assert_figures_equal(expected, resumed)
        for run in (ours, resumed):
            assert not order_mismatches([r["launched"] for r in run]), name
