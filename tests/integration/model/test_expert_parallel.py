"""Expert parallelism folded over data parallelism equals the serial run (fp32, rel 1e-5):
losses, grad norms, every parameter (each EP rank's experts are its rows of the serial
[E, ...] tensors), the validation loss, the per-layer figures (aux, z-loss, imbalance, the
bias's range) and the step's per-expert counts summed over the stage (what updates the bias)
— at ep 2 over dp 2 and ep 4 over dp 4 (EDP = 1) and ep 2 over dp 4 (EDP = 2), with both
dispatchers, ZeRO 0 and 1, a Mixtral and one with gated shared experts, and with routing
skewed so that every token picks experts 0 and 1: one expert takes every token and the EP
ranks holding experts 2 and 3 receive no rows at all. A checkpoint written at ep 2 resumes
at ep 1. The plan's parameters, model-state bytes and DP / EDP / EP wire bytes per rank
match what the runs measure."""
from __future__ import annotations

import math

import pytest
import torch

from megalite.config.layout import Layout
from megalite.model.moe import step as moe_step
from megalite.model.moe.layer import MoELayer
from megalite.plan.memory import make_plan
from tests.integration.model.test_moe_layouts import MOE, assert_figures_equal
from tests.layouts import (
    Prepared,
    assert_equal,
    composed,
    from_step,
    train_in_process,
    train_layouts,
)

pytestmark = pytest.mark.distributed

STEPS = 3
SHARED = ["model.moe.shared_experts=1", "model.moe.shared_expert_size=16",
          "model.moe.shared_expert_gate=true"]
SKEW = (2.0, 1.0, 0.0, 0.0)  # the routers' starting selection bias: experts 0 and 1 always


def record_counts(trainer):
    """Record the step's per-expert counts summed over the stage (what `update_bias` reads);
    returns the collector, which puts `update_bias` back and gives [step][layer] counts."""
    counts, original = [], moe_step.update_bias
    layers = sum(isinstance(m, MoELayer) for m in trainer.model.modules())

    def recording(bias, layer_counts, rate):
        if not counts or len(counts[-1]) == layers:
            counts.append([])
        counts[-1].append(layer_counts.tolist())
        original(bias, layer_counts, rate)

    moe_step.update_bias = recording

    def collect():
        moe_step.update_bias = original
        return counts
    return collect


def skewed(trainer):
    """`record_counts`, with every router's bias starting at SKEW."""
    for m in trainer.model.modules():
        if isinstance(m, MoELayer):
            m.gate.e_score_correction_bias.copy_(torch.tensor(SKEW))
    return record_counts(trainer)


def _assert_counts(serial, ranks):
    for res in ranks:
        for ours, theirs in zip(serial["extra"], res["extra"]):
            for a, b in zip(ours, theirs):
                assert all(math.isclose(x, y) for x, y in zip(a, b)), (a, b)


@pytest.fixture(scope="module")
def serial(tiny_data, tmp_path_factory):
    root, common = tmp_path_factory.mktemp("serial-ep"), [f"data.dir={tiny_data}", *MOE]
    return {"moe": train_in_process(root / "m", Prepared(common, record_counts), STEPS),
            "shared": train_in_process(root / "s", Prepared(common + SHARED, record_counts),
                                       STEPS),
            "skew": train_in_process(root / "k", Prepared(common, skewed), STEPS)}


def _wire(step_comm: dict, group: str) -> float:
    return sum(v["wire_bytes"] for k, v in step_comm.items() if k.startswith(group + "/"))


def _assert_plan(overrides, world, ranks):
    """The plan's parameters and model-state bytes per rank (the experts E/ep a rank, their
    states over EDP) and wire bytes per step: the DP reductions (to 5%: the step's figures'
    and losses' sums are not the plan's), the EDP reductions and the all-gather dispatch to
    the byte, the all-to-all's balanced-routing estimate to 25%."""
    cfg = composed(overrides)
    stage = make_plan(cfg, Layout.from_config(cfg, world, "cpu")).stages[0]
    exact = cfg.parallel.ep_dispatch == "allgather"
    for res in ranks:
        assert res["local_numel"] == stage.params
        for kind, got in res["bytes"].items():
            assert got == pytest.approx(stage.bytes[kind], rel=0.01), (overrides, kind)
        for group, rel in (("dp", 0.05), ("edp", 1e-9), ("ep", 1e-9 if exact else 0.25)):
            assert _wire(res["step_comm"], group) == pytest.approx(stage.comm[group], rel=rel), \
                (overrides, group, res["step_comm"], stage.comm)


def _check(serial, runs, results, world):
    for (reference, run), ranks in zip(runs, results):
        assert_equal(reference, ranks)
        assert_figures_equal(reference, ranks)
        _assert_counts(reference, ranks)
        if run.prepare is record_counts:  # (skewed routing: not the plan's balanced one)
            _assert_plan(run.run, world, ranks)


def test_ep2_over_dp2_equals_serial_and_resumes_at_ep1(tiny_data, tmp_path, serial):
    """ep 2 at dp 2: both dispatchers, ZeRO 0 and 1, shared experts, skewed routing (EP rank
    1 receives nothing); the alltoall ZeRO-1 run's checkpoint after step 1 resumed at ep 1
    continues the serial run."""
    common, ckpt = [f"data.dir={tiny_data}", *MOE, "ep=2"], tmp_path / "ckpt"
    skew = serial["skew"]["extra"]
    assert all(c[2] == c[3] == 0 and c[0] > 0 for step in skew for c in step), skew
    runs = [(serial["moe"], Prepared(common + ["zero=1", f"checkpoint.dir={ckpt}"],
                                     record_counts)),
            (serial["moe"], Prepared(common + ["parallel.ep_dispatch=allgather"],
                                     record_counts)),
            (serial["shared"], Prepared(common + SHARED + ["zero=1"], record_counts)),
            (serial["skew"], Prepared(common, skewed)),
            (serial["skew"], Prepared(common + ["zero=1", "parallel.ep_dispatch=allgather"],
                                      skewed))]
    _check(serial, runs, train_layouts(tmp_path, 2, [run for _, run in runs], STEPS,
                                       save_at=1), 2)
    resumed = train_in_process(tmp_path / "r", [f"data.dir={tiny_data}", *MOE,
                                                f"checkpoint.resume={ckpt / 'step_00000001'}"],
                               STEPS - 1)
    expected = {**from_step(serial["moe"], 1), "moe": serial["moe"]["moe"][1:]}
    assert_equal(expected, [resumed])
    assert_figures_equal(expected, [resumed])


def test_ep4_and_ep2_over_dp4_equal_serial(tiny_data, tmp_path, serial):
    """4 ranks: ep 4 (both dispatchers, ZeRO 0 and 1; skewed: EP ranks 2 and 3 receive
    nothing) and ep 2 with EDP 2 (the experts reduced and sharded over EDP; the replica check
    compares them over EDP every step)."""
    common = [f"data.dir={tiny_data}", *MOE]
    runs = [(serial["moe"], Prepared(common + ["ep=4", "zero=1"], record_counts)),
            (serial["moe"], Prepared(common + ["ep=4", "parallel.ep_dispatch=allgather"],
                                     record_counts)),
            (serial["moe"], Prepared(common + ["ep=2", "zero=1", "resilience.check_every=1"],
                                     record_counts)),
            (serial["skew"], Prepared(common + ["ep=4", "zero=1"], skewed))]
    _check(serial, runs, train_layouts(tmp_path, 4, [run for _, run in runs], STEPS), 4)
