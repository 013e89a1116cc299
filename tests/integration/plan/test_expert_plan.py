"""The plan's MoE traffic and parameters against what gloo ranks count (one 2-rank launch,
one step each): the all-to-all dispatch's EP bytes to the byte where a capacity makes every
expert keep the same rows on every rank (capacity_factor 0.25: C = ceil(k·T/(4E)) rows an
expert, each expert chosen more often than that), also with EP folded over TP (each rank
sends its own sequence-parallel tokens, the routed experts whole: TP carries only the
chosen experts of the MoE layer); at ep 1 the DP reductions carrying the experts' gradients
with the rest; each pipeline stage's parameters and model states where the first blocks
keep a dense MLP (`model.moe.first_dense_layers`)."""
from __future__ import annotations

import pytest

from megalite.config.layout import Layout
from megalite.plan.memory import make_plan
from tests.integration.model.test_moe_layouts import MOE
from tests.integration.plan.test_plan import group_wire_bytes
from tests.layouts import composed, train_layouts

pytestmark = pytest.mark.distributed

CAPPED = ["model.moe.capacity_factor=0.25"]
SHARED_RECOMPUTED = ["tp=2", "sp=true", "model.moe.shared_experts=1", "train.recompute=true"]
RUNS = [["ep=2", *CAPPED], ["zero=0"],
        [*SHARED_RECOMPUTED, "ep=2", *CAPPED], SHARED_RECOMPUTED,
        ["pp=2", "model.n_layer=3", "model.moe.first_dense_layers=1", "zero=1"]]


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


def test_moe_tp_and_ep_bytes_equal_the_counters_folded_or_not(measured):
    """tp2 sp with shared experts and recompute: EP folded over TP (ep 2: the routed experts'
    exchange of each rank's own tokens, again in a re-run; TP carries the chosen experts
    and the shared experts' tokens) and TP-split experts (ep 1: the tokens, choices and
    weights gathered, the outputs reduce-scattered), each group's bytes to the byte."""
    runs, results = measured
    for index in (2, 3):
        stage = _stage(runs[index])
        for res in results[index]:
            comm = res["step_comm"]
            for group in ("tp", "ep"):
                assert group_wire_bytes(comm, group) == stage.comm.get(group, 0.0), \
                    (runs[index], group, comm, stage.comm)


def test_each_stage_plans_its_own_blocks(measured):
    """pp 2 of 3 blocks, the first dense: stage 0 holds the dense block and an MoE one,
    stage 1 an MoE block and the head; each stage's parameters, model states, ZeRO buckets
    and pipeline bytes (the sends, the routing figures gathered) are its own blocks' (not block 0's
    times the blocks)."""
    runs, results = measured
    cfg = composed(runs[4])
    plan = make_plan(cfg, Layout.from_config(cfg, 2, "cpu"))
    for res in results[4]:
        stage = plan.stages[res["coords"][1]]
        assert res["local_numel"] == stage.params, (res["coords"], stage.params)
        for kind, got in res["bytes"].items():
            assert got == pytest.approx(stage.bytes[kind], rel=1e-6), kind
        assert res["grad_staging"] == stage.declared_staging  # its buckets, block by block
        assert group_wire_bytes(res["step_comm"], "pp") == stage.comm["pp"]


def test_moe_at_ep1_reduces_its_experts_over_dp(measured):
    """The experts' gradients travel with the rest over DP at ep 1, and the step's routing
    figures are summed over DP: to the byte."""
    runs, results = measured
    stage = _stage(runs[1])
    for res in results[1]:
        got = group_wire_bytes(res["step_comm"], "dp")
        assert got == stage.comm["dp"], (res["step_comm"], stage.comm)
        assert "ep" not in stage.comm and "edp" not in stage.comm
