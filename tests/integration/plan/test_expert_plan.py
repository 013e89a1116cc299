"""The plan's MoE traffic against what gloo ranks count (one 2-rank launch, one step each):
the all-to-all dispatch's EP bytes to the byte where a capacity makes every expert keep the
same rows on every rank (capacity_factor 0.25: C = ceil(k·T/(4E)) rows an expert, each
expert chosen more often than that), and at ep 1 the DP reductions carrying the experts'
gradients with the rest."""
from __future__ import annotations

import pytest

from megalite.config.layout import Layout
from megalite.plan.memory import make_plan
from tests.integration.model.test_moe_layouts import MOE
from tests.integration.plan.test_plan import group_wire_bytes
from tests.layouts import composed, train_layouts

pytestmark = pytest.mark.distributed

RUNS = [["ep=2", "model.moe.capacity_factor=0.25"], ["zero=0"]]


@pytest.fixture(scope="module")
def measured(tiny_data, tmp_path_factory):
    runs = [[f"data.dir={tiny_data}", *MOE, *run] for run in RUNS]
    return runs, train_layouts(tmp_path_factory.mktemp("ep-plan"), 2, runs, steps=1)


def _stage(overrides):
    cfg = composed(overrides)
    return make_plan(cfg, Layout.from_config(cfg, 2, "cpu")).stages[0]


def test_alltoall_bytes_equal_the_counters_to_the_byte(measured):
    runs, results = measured
    stage = _stage(runs[0])
    for res in results[0]:
        assert group_wire_bytes(res["step_comm"], "ep") == stage.comm["ep"], \
            (res["step_comm"], stage.comm)
        assert res["moe"][-1] is not None


def test_moe_at_ep1_reduces_its_experts_over_dp(measured):
    """The experts' gradients travel with the rest over DP at ep 1 (within 2%: the step's
    MoE figures and losses are summed over DP too)."""
    runs, results = measured
    stage = _stage(runs[1])
    for res in results[1]:
        got = group_wire_bytes(res["step_comm"], "dp")
        assert got == pytest.approx(stage.comm["dp"], rel=0.02), (res["step_comm"], stage.comm)
        assert "ep" not in stage.comm and "edp" not in stage.comm
