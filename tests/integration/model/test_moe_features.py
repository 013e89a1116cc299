"""A Mixtral with the aux loss, the z-loss and the bias on, with the training features: under
data parallelism, activation recomputation (every block, or the first) and activation offload
equal the plain serial run (fp32, 1e-5: losses, grad norms, parameters, the per-layer figures
and so the bias and counts), FP8 tensorwise on the experts (dp 2, tp 2 + SP, cp 2, ep 2 over
dp 2 and over tp 2 + SP) its serial FP8 run within the combination matrix's fp32 + FP8 bounds,
every rank launching its collectives in one order; a ramped-up batch weighs the aux loss and
z-loss of each micro-batch by the step's changing micro-batch count, as a penalty computed here
from the routers' outputs says; the rerun attribution pins a persistent fault on its rank
(re-executions and the other replica's recomputation of the micro-batches reproduce the MoE
step)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megalite.config.layout import validate
from megalite.config.model import ModelConfig
from megalite.config.moe import MoEConfig
from megalite.model.families import causal_lm
from megalite.model.moe import balance
from megalite.parallel.pipeline import micro_batch_parts
from megalite.resilience.faults import HARDWARE_FAULT_EXIT
from megalite.testing.collective_order import OrderProbe, order_mismatches
from megalite.testing.matrix import TOLERANCES, Tolerance
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.integration.model.test_moe_layouts import MOE, assert_figures_equal
from tests.layouts import (
    assert_equal,
    composed,
    fit_to_exit,
    master_update_error,
    train_in_process,
    train_layouts,
)
from tests.moe_layers import router_outputs

STEPS = 3
FP8 = ["fp8.recipe=tensorwise", "fp8.emulate=true"]

pytestmark = pytest.mark.distributed


def _common(tiny_data):
    return [f"data.dir={tiny_data}", *MOE]


@pytest.fixture(scope="module")
def serial(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("serial")
    return {"plain": train_in_process(root / "p", _common(tiny_data), STEPS),
            "fp8": train_in_process(root / "f", _common(tiny_data) + FP8, STEPS)}


def assert_fp8_close(serial: dict, ranks: list, tol: Tolerance) -> None:
    """Losses and grad norms within the matrix's FP8 bounds; each rank's fp32 master weights'
    distance from its slice of the serial run's within its update error of how far the
    serial run moved them (`master_update_error`, the matrix's measure)."""
    for r in ranks:
        for key, rel in (("losses", tol.loss), ("norms", tol.norm)):
            for a, b in zip(serial[key], r[key]):
                assert math.isclose(a, b, rel_tol=rel), (key, a, b)
        assert master_update_error(serial, r) <= tol.update, master_update_error(serial, r)


def test_recompute_offload_and_fp8_experts_under_dp_equal_serial_in_one_order(tiny_data,
                                                                              tmp_path, serial):
    """dp 2, one launch under the order probe: recompute (zero 1), activation offload
    (zero 2), the first block recomputed and the next offloaded (zero 3) equal the plain
    serial run at 1e-5; FP8 experts (zero 1, recomputed, tp 2 + SP, cp 2, ep 2 over dp 2
    and ep 2 folded over tp 2 + SP with the all-gather dispatch) their serial FP8 run within
    the matrix's fp32 + FP8 bounds, whose experts are quantized (the losses move off the
    plain run's)."""
    common = _common(tiny_data)
    runs = {"recompute": common + ["zero=1", "train.recompute=true"],
            "offload": common + ["zero=2", "offload.activations=true"],
            "both": common + ["zero=3", "train.recompute=true", "train.recompute_layers=1",
                              "offload.activations=true"],
            "fp8": common + FP8 + ["zero=1"],
            "fp8-recompute": common + FP8 + ["zero=0", "train.recompute=true"],
            "fp8-tp": common + FP8 + ["tp=2", "sp=true"],
            "fp8-cp": common + FP8 + ["cp=2"],
            "fp8-ep": common + FP8 + ["ep=2", "zero=1"],
            "fp8-ep-tp": common + FP8 + ["ep=2", "tp=2", "sp=true",
                                         "parallel.ep_dispatch=allgather"]}
    results = train_layouts(tmp_path, 2, list(runs.values()), STEPS, probe=True)
    for name, ranks in zip(runs, results):
        assert not order_mismatches([r["launched"] for r in ranks]), name
        if name.startswith("fp8"):
            assert_fp8_close(serial["fp8"], ranks, TOLERANCES["fp32", True])
            continue
        assert_equal(serial["plain"], ranks)
        assert_figures_equal(serial["plain"], ranks)
        if name != "recompute":
            assert all(max(r["offload_peaks"]) > 0 for r in ranks), name
    plain, fp8 = serial["plain"]["losses"], serial["fp8"]["losses"]
    assert plain[0] != fp8[0] and abs(plain[0] - fp8[0]) < 1e-2 * plain[0]


def _penalized_norm(model_cfg: ModelConfig, state: dict, micro_batches: list) -> float:
    """The grad norm of mean over micro-batches of CE + Σ_layers (c · aux + z · z-loss), the
    penalty computed here from the routers' outputs of a model without one."""
    moe = model_cfg.moe
    plain = ModelConfig(**{**model_cfg.__dict__, "moe": MoEConfig(
        **{**moe.__dict__, "aux_loss_coeff": 0.0, "z_loss_coeff": 0.0})})
    model = causal_lm(plain)
    model.load_state_dict(state)
    model.train()
    seen = router_outputs(model)
    total = 0.0
    for batch in micro_batches:
        x, y, _ = micro_batch_parts(batch)
        seen.clear()
        loss = model(x, y)
        for r in seen:
            routed = torch.bincount(r.indices.reshape(-1), minlength=moe.num_experts)
            loss = loss + moe.aux_loss_coeff * balance.layer_aux(r.scores, routed, moe.top_k) \
                + moe.z_loss_coeff * balance.z_loss(r.logits)
        total = total + loss / len(micro_batches)
    total.backward()
    return math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters()))


def test_rampup_weighs_the_penalty_by_the_steps_micro_batches(tiny_data, tmp_path):
    """train.rampup_batch_size=[8,8,16]: steps of 2, 2 and 4 micro-batches; each step's grad
    norm equals that of the mean over its micro-batches of the cross-entropy plus the
    penalty, computed here (aux coefficient 1, z-loss 0.1: the penalty weighs)."""
    cfg = composed(_common(tiny_data) + ["train.rampup_batch_size=[8,8,16]",
                                         "model.moe.aux_loss_coeff=1.0",
                                         "model.moe.z_loss_coeff=0.1"])
    validate(cfg, 1)
    trainer = build_trainer(cfg, init_runtime(cfg), tmp_path)
    (chunk,) = trainer.model.chunks
    counts = []
    for _ in range(STEPS):
        state = {k: v.detach().clone() for k, v in chunk.state_dict().items()}
        _, norm = trainer.train_step()
        batches = trainer.last_micro_batches
        counts.append(len(batches))
        expected = _penalized_norm(cfg.model, state, batches)
        assert math.isclose(norm, expected, rel_tol=1e-5), (len(batches), norm, expected)
    assert counts == [2, 2, 4]


def _drill(rank, world, cfg, run_dir):
    """A run with a fault drill under the order probe: the exit code, fault.json, the
    launches."""
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), Path(run_dir))
    probe = OrderProbe.install(trainer.topo.counter)
    code, fault = fit_to_exit(trainer, run_dir)
    return {"code": code, "step": trainer.step, "launched": probe.launched, "fault": fault}


def test_rerun_attribution_pins_a_persistent_fault_on_its_rank(tiny_data, tmp_path):
    """resilience.rerun=on_nan, rank 1's norm weight broken at step 2 in every computation:
    the step is re-executed (rank 0 reproduces its MoE step within 1e-5) and each replica
    recomputes the other's micro-batches; fault.json names rank 1, persistent, and both
    ranks exit with the hardware code, launching their collectives in one order."""
    cfg = composed(_common(tiny_data) + [
        "zero=0", f"train.max_steps={STEPS}", "resilience.rerun=on_nan",
        "resilience.allow_inject=true", "resilience.inject=rank:1/step:2/target:param/kind:persistent"])
    ranks = run_ranks(_drill, 2, args=(cfg, str(tmp_path)), timeout_s=300)
    assert not order_mismatches([r["launched"] for r in ranks])
    for run in ranks:
        assert run["code"] == HARDWARE_FAULT_EXIT and run["step"] == 1, run["code"]
        fault = run["fault"]
        assert (fault["rank"], fault["step"], fault["kind"]) == (1, 2, "persistent"), fault
        assert [s["rank"] for s in fault["suspects"]] == [1], fault
