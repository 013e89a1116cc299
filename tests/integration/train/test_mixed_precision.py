"""Mixed precision on real ranks: bf16 / fp16 parameters and activations with fp32 master
weights, gradients and moments (the CUDA default, here run on CPU), and fp16 loss scaling.

Reduced precision rounds differently in every layout, so a parallel run is compared with the
serial run of the same precision within tolerances far below what a lost, doubled or unscaled
gradient would cause (fp32 layouts are compared exactly-ish in the other test files). What
holds exactly in any precision: DP replicas are bitwise identical, and every parameter is its
fp32 master weight cast down.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.layouts import master_update_error, train_layouts
from tests.unit.train.test_mixed_precision import LEARNING

LAYOUTS = [["tp=2", "sp=true", "zero=1"], ["pp=2", "zero=3"]]
# measured at 6 steps (bf16 / fp16): loss 3.6e-4 / 3.5e-4, grad norm 1.0e-2 / 2.9e-3, master
# update error 0.07 / 0.04 at worst; a missing gradient reduction or update is of order 1
TOLERANCE = {"bf16": {"loss": 3e-3, "norm": 5e-2, "master": 0.25},
             "fp16": {"loss": 3e-3, "norm": 2e-2, "master": 0.2}}


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_layouts_track_the_serial_run(tiny_data, tmp_path, precision):
    common = [f"data.dir={tiny_data}", f"precision={precision}", *LEARNING]
    (serial,), = train_layouts(tmp_path / "serial", 1, [common], steps=6)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert serial["losses"][-1] < serial["losses"][0] - 0.5  # it learns
    tol = TOLERANCE[precision]
    for layout, ranks in zip(LAYOUTS, train_layouts(tmp_path / "par", 4,
                                                    [common + lo for lo in LAYOUTS], steps=6)):
        replicas = {}
        for res in ranks:
            assert all(p.dtype == dtype for p in res["params"][0].values())
            assert all(res["masters_cast"]), (layout, res["coords"])
            for s in range(6):
                assert math.isclose(res["losses"][s], serial["losses"][s],
                                    rel_tol=tol["loss"]), (layout, s)
                assert math.isclose(res["norms"][s], serial["norms"][s],
                                    rel_tol=tol["norm"]), (layout, s)
            err = master_update_error(serial, res)
            assert err < tol["master"], (layout, res["coords"], err)
            tp, pp, dp = res["coords"]
            replicas.setdefault((tp, pp), []).append(res)
        for group in replicas.values():  # DP replicas: bitwise the same parameters
            first, *others = group
            for other in others:
                for s in range(6):
                    for name, value in first["params"][s].items():
                        assert torch.equal(value, other["params"][s][name]), (layout, s, name)
