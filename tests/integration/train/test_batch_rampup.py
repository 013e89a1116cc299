"""Batch-size ramp-up (train.rampup_batch_size, Megatron's --rampup-batch-size): the global
batch grows with the samples consumed; every layout trains the same steps as the serial run,
also when resumed mid-ramp under another layout."""
from __future__ import annotations

import pytest

from tests.layouts import assert_equal, from_step, train_layouts
from tests.unit.train.test_batch_rampup import RAMP


@pytest.mark.distributed
def test_ramp_in_every_layout_equals_serial_and_resumes_mid_ramp(tiny_data, tmp_path):
    common = [f"data.dir={tiny_data}", *RAMP]
    writer = common + [f"checkpoint.dir={tmp_path / 'ckpt'}"]
    four = common + ["model.n_layer=4"]  # zb-v: 2 slices per stage
    writer4 = four + [f"checkpoint.dir={tmp_path / 'ckpt4'}"]
    ((serial,), (serial4,)) = train_layouts(tmp_path / "s", 1, [writer, writer4], steps=6,
                                            save_at=3)
    step3 = tmp_path / "ckpt" / "step_00000003"
    ramped = train_layouts(tmp_path / "p", 2, [
        common + ["zero=1"], common + ["pp=2"], common + ["pp=2", "parallel.schedule=zb-h1"],
        four + ["pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2"]],
        steps=6)  # zero bubble: m = 2, 2, 4, 6, 8, 8, the schedule's order per step
    for ranks in ramped[:3]:
        assert_equal(serial, ranks)
    assert_equal(serial4, ramped[3])
    (resumed,) = train_layouts(tmp_path / "r", 2, [
        [f"data.dir={tiny_data}", *RAMP, "zero=2", f"checkpoint.resume={step3}"]], steps=3)
    assert_equal(from_step(serial, 3), resumed)
