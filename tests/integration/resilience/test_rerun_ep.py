"""Rerun attribution and the replica check under expert parallelism (4 gloo ranks, one launch).
ep 2 over dp 4 joins DP replicas 0-1 and 2-3 into two domains (each EP group's tokens run
through each other's experts; `megalite.resilience.verdicts.replica_domains`): a healthy step
made suspicious is judged the data (domain 1 recomputing domain 0's micro-batches computes
the same local gradients, experts' included); a flipped exponent bit in rank 2's norm in
front of the experts, whose non-finite rows reach its EP peer 3's experts, is a transient
fault on ranks 2 and 3 (not non-determinism: one domain changed), and as a persistent one
is pinned on the same ranks by the cross-domain recomputation. ep 4
over dp 4 is one domain: a reproduced step is unresolved, as with dp = 1. The replica check
compares the experts over EDP: a bit flipped in rank 2's copy names the edp group [0, 2]."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.resilience.faults import HARDWARE_FAULT_EXIT
from megalite.resilience.replicas import ReplicaMismatchError
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.integration.model.test_moe_layouts import MOE
from tests.layouts import FP32_NO_DROPOUT, fit_to_exit

pytestmark = pytest.mark.distributed

EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"  # rank 2 holds experts 0-1 (EP rank 0)
# the norm in front of block 0's experts: 1.0 flipped to inf makes rank 2's rows non-finite,
# and those it sends make its EP peer's expert gradients non-finite (a flip in an expert
# weight itself gives a finite 1e36 that the next norm scales away: no NaN, no verdict)
NORM = "model.layers.0.post_attention_layernorm.weight"
INJECT = f"resilience.inject=rank:2/step:1/target:param/tensor:{NORM}/kind:"


def _trainer(tiny_data, run_dir, world, steps, *extra):
    cfg = load_config(TINY + FP32_NO_DROPOUT + MOE + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        f"train.max_steps={steps}", "resilience.straggler_report_every=0",
        "resilience.check_every=0", *extra])
    validate(cfg, world)
    return build_trainer(cfg, init_runtime(cfg), Path(run_dir))


def _judged(rank, world, tiny_data, run_dir, steps, overrides, drill=False):
    """A run through the CLI's fit_or_exit (`drill`: its first step made suspicious): the
    exit code, the verdict counts and fault.json."""
    trainer = _trainer(tiny_data, run_dir, world, steps, "resilience.rerun=on_nan",
                       "resilience.allow_inject=true", *overrides)
    if drill:
        trainer.rerun.drill_next_step("made suspicious by the test")
    code, fault = fit_to_exit(trainer, run_dir)
    return {"code": code, "step": trainer.step, "state": trainer.rerun.state_dict(),
            "injected": None if trainer.injector is None else trainer.injector.injected,
            "fault": fault}


def _flipped(rank, world, tiny_data, run_dir):
    """One step checked after it; rank 2 flips a low mantissa bit of its experts first."""
    trainer = _trainer(tiny_data, run_dir, world, 1, "ep=2", "zero=1",
                       "resilience.check_every=1")
    step = trainer.train_step

    def train_step():
        result = step()
        if rank == 2:
            (p,) = [p for local, p in trainer.model.named_parameters()
                    if trainer.model.param_specs[local].name == EXPERTS]
            with torch.no_grad():
                p.data.view(-1).view(torch.int32)[5] ^= 8
        return result

    trainer.train_step = train_step
    try:
        trainer.fit()
    except ReplicaMismatchError as e:
        return str(e)
    return None


def _all_runs(rank, world, tiny_data, run_dir):
    return {"data": _judged(rank, world, tiny_data, f"{run_dir}/d", 2, ["ep=2", "zero=1"],
                            drill=True),
            "one domain": _judged(rank, world, tiny_data, f"{run_dir}/u", 1, ["ep=4"],
                                  drill=True),
            "transient": _judged(rank, world, tiny_data, f"{run_dir}/t", 1,
                                 ["ep=2", INJECT + "transient"]),
            "persistent": _judged(rank, world, tiny_data, f"{run_dir}/p", 1,
                                  ["ep=2", INJECT + "persistent"]),
            "replica check": _flipped(rank, world, tiny_data, f"{run_dir}/c")}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    return run_ranks(_all_runs, 4, args=(tiny_data, str(tmp_path_factory.mktemp("rerun-ep"))),
                     timeout_s=300)


def test_a_healthy_step_is_no_fault_and_an_expert_fault_is_pinned_on_its_ep_group(runs):
    """No false fault: the drilled step is the data at ep 2 over dp 4 (skipped, the run goes
    on to step 2) and unresolved at ep 4 (one domain). A flipped exponent bit in rank 2's
    norm in front of the experts: transient, then persistent, on ranks 2 and 3 (its EP
    group), exit 75."""
    for res in runs:
        data, single = res["data"], res["one domain"]
        assert data["code"] is None and data["fault"] is None and data["step"] == 2, data
        assert data["state"]["data_skips"] == 1 and data["state"]["reruns"] == 1, data
        assert single["code"] is None and single["fault"] is None, single
        assert single["state"]["unresolved"] == 1 and single["state"]["data_skips"] == 0
        for kind in ("transient", "persistent"):
            run = res[kind]
            assert run["code"] == HARDWARE_FAULT_EXIT and run["step"] == 0, (kind, run)
            fault = run["fault"]
            assert (fault["kind"], fault["step"], fault["rank"]) == (kind, 1, 2), fault
            assert [s["rank"] for s in fault["suspects"]] == [2, 3], fault


def test_the_replica_check_names_the_edp_group_of_a_diverged_expert(runs):
    """ep 2 over dp 4 (EDP 2): rank 2's copy of experts 0-1 differs from rank 0's."""
    for res in runs:
        error = res["replica check"]
        assert error is not None and "after step 1" in error, error
        assert (f"edp replicas on global ranks [0, 2] differ in {EXPERTS} (suspect ranks 0, "
                "2)") in error, error
        assert "dp replicas" not in error.replace("edp replicas", ""), error
