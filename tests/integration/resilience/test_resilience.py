"""Faults that do not crash (megalite.resilience): a flipped bit in one replica is found by the
replica check and stops the run before its checkpoint; a rank slowed down is named by the
straggler report; bad `resilience.*` values are refused before launch."""
from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest
import torch

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.resilience.replicas import (
    ReplicaMismatchError,
    replica_sets,
)
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.metrics import wandb_row
from megalite.train.runtime import init_runtime
from megalite.utils.log import get_logger
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

FLIPPED = "transformer.h.0.ln_1.weight"  # a LayerNorm: DP- and TP-replicated
FLIP_AFTER = 4  # the step after which rank 1's copy gets a flipped bit
DELAY_S = 0.3


def _trainer(tiny_data, run_dir, world, *extra):
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        f"checkpoint.dir={run_dir}/ckpt", "log.peak_tflops=1", *extra])
    validate(cfg, world)
    return build_trainer(cfg, init_runtime(cfg), Path(run_dir))


def _flip_a_bit(trainer, name: str) -> None:
    """One low mantissa bit of one element of `name` (this rank's copy), as a faulty device
    would leave it."""
    for local, p in trainer.model.named_parameters():
        if trainer.model.param_specs[local].name == name:
            with torch.no_grad():
                bits = p.data.view(-1).view(torch.int32)
                bits[5] = bits[5] ^ 8
            return
    raise KeyError(name)


def _flipped_run(rank, world, tiny_data, run_dir, overrides):
    """Six steps checked every two and checkpointed every two; rank 1 flips a bit of its
    LayerNorm right after step FLIP_AFTER. The error (every rank's) and what was published."""
    trainer = _trainer(tiny_data, run_dir, world, "train.max_steps=6", "checkpoint.every=2",
                       "resilience.check_every=2", *overrides)
    step = trainer.train_step

    def train_step():
        result = step()
        if trainer.step == FLIP_AFTER and rank == 1:
            _flip_a_bit(trainer, FLIPPED)
        return result

    trainer.train_step = train_step
    error = None
    try:
        trainer.fit()
    except ReplicaMismatchError as e:
        error = str(e)
    return {"error": error, "step": trainer.step, "passed": trainer.replicas.checks,
            "published": sorted(p.name for p in (Path(run_dir) / "ckpt").iterdir())}


CLEAN = {"dp2 zero1": ["zero=1"], "dp2 zero0": ["zero=0"], "tp2 sp": ["tp=2", "sp=true"],
         "tp2": ["tp=2"], "pp2": ["pp=2"], "cp2 zero0": ["cp=2", "zero=0"]}
CLEAN_STEPS = 3


def _clean_run(rank, world, tiny_data, run_dir, overrides):
    """A few steps, checked after every one: what was compared, how many checks passed."""
    trainer = _trainer(tiny_data, run_dir, world, f"train.max_steps={CLEAN_STEPS}",
                       "resilience.check_every=1", *overrides)
    trainer.fit()
    sets = replica_sets(trainer.engine, trainer.topo, trainer.replicas.tp_rtol)
    return {"passed": trainer.replicas.checks, "compared": {rs.kind: rs.names for rs in sets},
            "rtol": {rs.kind: rs.rtol for rs in sets}}


def _all_runs(rank, world, tiny_data, run_dir):
    """Every run of this module's distributed tests, in one launch of 2 ranks."""
    return {"dp": _flipped_run(rank, world, tiny_data, f"{run_dir}/dp",
                               ["zero=1", "checkpoint.async_save=true"]),
            "tp": _flipped_run(rank, world, tiny_data, f"{run_dir}/tp", ["tp=2", "sp=true"]),
            "dp_cp": _flipped_run(rank, world, tiny_data, f"{run_dir}/cp", ["cp=2"]),
            "clean": {label: _clean_run(rank, world, tiny_data, f"{run_dir}/{i}", overrides)
                      for i, (label, overrides) in enumerate(CLEAN.items())},
            "slowed": _straggler_run(rank, world, tiny_data, f"{run_dir}/slow", slow_rank=1),
            "even": _straggler_run(rank, world, tiny_data, f"{run_dir}/even", slow_rank=None)}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Results per rank of `_all_runs`."""
    return run_ranks(_all_runs, 2, args=(tiny_data, str(tmp_path_factory.mktemp("resil"))),
                     timeout_s=300)


@pytest.mark.distributed
def test_a_flipped_bit_stops_the_run_before_its_checkpoint_and_clean_runs_pass(runs):
    """A flipped bit in rank 1's LayerNorm — a DP replica (zero 1, async saves) and a TP
    replica (tp 2 + SP) and a CP replica (cp 2: the DP x CP ranks hold the same
    parameters) — is found by the check at that step on both ranks, naming the step,
    the group's ranks and the tensor; step 2's checkpoint is published, step 4's is not.
    Without a flip, checks after every step pass under dp 2 (zero 1 and zero 0), tp 2 (with
    and without SP), pp 2 and cp 2, each comparing what its layout replicates."""
    for res in runs:
        for kind in ("dp", "tp", "dp_cp"):
            run = res[kind]
            assert run["error"] is not None, (kind, run)
            assert run["step"] == FLIP_AFTER and run["passed"] == 1, (kind, run)
            assert f"after step {FLIP_AFTER}" in run["error"], run["error"]
            assert (f"{kind} replicas on global ranks [0, 1] differ in {FLIPPED} "
                    "(suspect ranks 0, 1)") in run["error"], run["error"]
            assert "differ in transformer.h.0.ln_1.bias" not in run["error"]
            assert run["published"] == ["step_00000002"], run
        clean = res["clean"]
        for label, run in clean.items():
            assert run["passed"] == CLEAN_STEPS, (label, run)
        assert set(clean["dp2 zero1"]["compared"]) == {"dp"}
        assert FLIPPED in clean["dp2 zero1"]["compared"]["dp"]
        assert not any("AdamW" in n for n in clean["dp2 zero1"]["compared"]["dp"])
        assert f"{FLIPPED} (AdamW exp_avg_sq)" in clean["dp2 zero0"]["compared"]["dp"]
        assert set(clean["cp2 zero0"]["compared"]) == {"dp_cp"}, clean["cp2 zero0"]
        assert f"{FLIPPED} (AdamW exp_avg_sq)" in clean["cp2 zero0"]["compared"]["dp_cp"]
        for label in ("tp2 sp", "tp2"):
            tp = clean[label]["compared"]["tp"]
            assert FLIPPED in tp and "transformer.wpe.weight" in tp, tp
            assert not any("c_attn.weight" in n for n in tp), tp
        # bitwise where equal by construction (SP all-reduces their gradients), else within
        # resilience.tp_rtol (default 1e-3); DP replicas always bitwise
        assert clean["tp2 sp"]["rtol"] == {"tp": None}, clean["tp2 sp"]["rtol"]
        assert clean["tp2"]["rtol"] == {"tp": 1e-3}, clean["tp2"]["rtol"]
        assert clean["dp2 zero1"]["rtol"] == {"dp": None}
        tied = clean["pp2"]["compared"]  # the first stage's wte, the last's LM head copy
        assert list(tied) == ["embedding"] and len(tied["embedding"]) == 1, tied
        assert "transformer.wte.weight" in tied["embedding"][0], tied


def _straggler_run(rank, world, tiny_data, run_dir, slow_rank):
    """dp 2, four steps in windows of two; `slow_rank` (if any) sleeps DELAY_S in its
    forward/backward every step. Rank 0 returns its reports and logged warnings."""
    trainer = _trainer(tiny_data, run_dir, world, "zero=1", "train.max_steps=4",
                       "log.every=4", "resilience.straggler_report_every=2",
                       "resilience.straggler_factor=1.5", "resilience.straggler_min_s=0.1")
    if rank == slow_rank:
        run = trainer.schedule.train_step
        trainer.schedule.train_step = lambda *a, **k: (time.sleep(DELAY_S), run(*a, **k))[1]
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    get_logger().addHandler(handler)
    try:
        records = trainer.fit()
    finally:
        get_logger().removeHandler(handler)
    return {"steps": [r["step"] for r in records], "warnings": warnings,
            "reports": [r["straggler_report"] for r in records if "straggler_report" in r],
            "wandb": [wandb_row(r) for r in records]}


@pytest.mark.distributed
def test_a_slowed_rank_is_named_within_a_window_and_an_even_run_names_none(runs):
    """Rank 1 computes DELAY_S longer per step; rank 0 waits for it in the gradient
    reduction, which does not count as compute. Every window of two steps names rank 1's
    forward/backward (and step) and never rank 0; the same thresholds name nobody in an
    unslowed run."""
    slowed, even = runs[0]["slowed"], runs[0]["even"]
    assert slowed["steps"] == [2, 4] and len(slowed["reports"]) == 2, slowed
    for report in slowed["reports"]:
        named = {(s["rank"], s["phase"]) for s in report["stragglers"]}
        assert (1, "forward_backward") in named and (1, "step") in named, report
        assert all(s["rank"] == 1 for s in report["stragglers"]), report
        s = next(s for s in report["stragglers"] if s["phase"] == "forward_backward")
        assert s["compute_s"] - s["median_s"] >= 0.8 * DELAY_S, s
        assert s["host"] == socket.gethostname() and s["gpu"] is None, s
    assert report["steps"] == [3, 4]
    assert any("straggler: rank 1 " in w and "forward_backward" in w
               for w in slowed["warnings"]), slowed["warnings"]
    assert slowed["wandb"][0]["perf/stragglers"] >= 1
    assert len(even["reports"]) == 2, even
    assert all(r["stragglers"] == [] for r in even["reports"]), even["reports"]
    assert not any("straggler" in w for w in even["warnings"]), even["warnings"]
    assert runs[1]["slowed"]["reports"] == []  # rank 0 reports
