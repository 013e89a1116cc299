"""Blended datasets (`data.blend`, Megatron's weighted --data-path): the greedy blend keeps every
prefix within one sample of its shares, DP ranks split the serial batches, the position resumes
exactly, blends of different tokenizers are refused, and training on a blend under DP (and
resumed under another layout) equals the serial run."""
from __future__ import annotations

import pytest

from megalite.checkpoint.format import read_meta
from tests.layouts import assert_equal, from_step, train_layout


@pytest.mark.distributed
def test_training_on_a_blend_equals_serial_under_dp_and_resumes(tiny_data, second_data,
                                                                 tmp_path):
    root = tmp_path / "ckpt"
    common = [f"data.blend=[0.75,{tiny_data},0.25,{second_data}]", "train.micro_batch_size=2",
              "train.global_batch_size=8", "train.eval_every=0"]
    (serial,) = train_layout(tmp_path / "s", 1, common + [f"checkpoint.dir={root}"], steps=6,
                             save_at=3)
    meta = read_meta(root / "step_00000003")
    assert meta["sampler"] == {"consumed_samples": 24, "counts": [18, 6], "order": "bijection-v1"}
    assert meta["data_sources"] == [[str(tiny_data), 0.75], [str(second_data), 0.25]]
    assert_equal(serial, train_layout(tmp_path / "dp", 2, common + ["zero=1"], steps=6))
    resumed = train_layout(tmp_path / "r", 2, common + [
        f"checkpoint.resume={root / 'step_00000003'}"], steps=3)
    assert_equal(from_step(serial, 3), resumed)
