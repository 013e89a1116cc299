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

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import check_sections, load_config
from megalite.parallel.group import CollectiveWaits
from megalite.parallel.topology import Topology
from megalite.resilience.replicas import (
    TP_CHUNK,
    ReplicaMismatchError,
    chunks_of,
    disagreements,
    fingerprint,
    odd_members,
    odd_within,
    replica_sets,
    sums_and_norms,
)
from megalite.resilience.stragglers import find_slow, peer_groups
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.metrics import wandb_row
from megalite.train.runtime import init_runtime
from megalite.train.timers import StepTimers
from megalite.utils.clock import DeviceClock
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
         "tp2": ["tp=2"], "pp2": ["pp=2"]}
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
    replica (tp 2 + SP) — is found by the check at that step on both ranks, naming the step,
    the group's ranks and the tensor; step 2's checkpoint is published, step 4's is not.
    Without a flip, checks after every step pass under dp 2 (zero 1 and zero 0), tp 2 (with
    and without SP) and pp 2, each comparing what its layout replicates."""
    for res in runs:
        for kind in ("dp", "tp"):
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


# --- pure logic, no ranks --------------------------------------------------------------


@pytest.mark.parametrize("key, value", [
    ("resilience.check_every", -1), ("resilience.straggler_report_every", -5),
    ("resilience.straggler_factor", 1.0), ("resilience.straggler_factor", 0.5),
    ("resilience.straggler_min_s", -0.1), ("resilience.tp_rtol", -1e-3),
    ("resilience.tp_rtol", 1.0)])
def test_bad_resilience_values_are_refused_naming_the_key(key, value):
    cfg = load_config([f"{key}={value}"])
    with pytest.raises(ConfigError, match=rf"^{key}="):
        check_sections(cfg)


def test_resilience_defaults_are_valid_and_zero_turns_them_off():
    for overrides in ([], ["resilience.check_every=0", "resilience.straggler_report_every=0",
                           "resilience.straggler_min_s=0"]):
        check_sections(load_config(overrides))


def test_fingerprints_are_exact_and_see_one_flipped_bit():
    x = torch.randn(1000)
    y = x.clone()
    y.view(torch.int32)[123] ^= 1  # the lowest mantissa bit
    assert not torch.equal(fingerprint([x], x.device), fingerprint([y], x.device))
    assert torch.equal(fingerprint([x, x.bfloat16()], x.device),
                       fingerprint([x.clone(), x.bfloat16().clone()], x.device))
    assert fingerprint([x.flip(0)], x.device) == fingerprint([x], x.device)  # no order


def test_the_odd_replica_is_named_by_majority_or_all_are():
    assert odd_members([5, 5, 7, 5]) == [2]
    assert odd_members([5, 7]) == [0, 1]  # two replicas: either may be wrong
    assert odd_members([1, 2, 3]) == [0, 1, 2]
    lines = disagreements("dp", [0, 4, 8], ["a", "b", "c"], [[1, 2, 3], [1, 2, 3], [1, 9, 3]])
    assert lines == ["dp replicas on global ranks [0, 4, 8] differ in b (suspect rank 8)"]
    assert disagreements("tp", [0, 1], ["a"], [[1], [1]]) == []


def test_tp_replicas_without_sp_agree_within_the_tolerance_and_corruption_does_not():
    """The tolerance path (TP replicas without SP): a rounding-level drift between two
    replicas passes where the bitwise check would fail; a flipped high exponent bit, a sign
    flip of a large element and a NaN are found, naming the odd replica of three."""
    torch.manual_seed(0)
    x = torch.randn(768)
    drift = x * (1 + 1e-6 * torch.randn(768))
    big = x.abs().argmax()

    def table(*replicas):
        return [[sums_and_norms([t], x.device)[0].tolist()] for t in replicas]

    def corrupt(change):
        y = x.clone()
        change(y)
        return y

    assert disagreements("tp", [0, 1], ["ln"], table(x, drift), rtol=1e-3) == []
    bitwise = [[int(fingerprint([t], x.device)[0])] for t in (x, drift)]
    assert disagreements("tp", [0, 1], ["ln"], bitwise) != []  # what tp_rtol=0 would say
    exponent = corrupt(lambda y: y.view(torch.int32)[7].bitwise_xor_(1 << 30))
    sign = corrupt(lambda y: y[big].neg_())
    nan = corrupt(lambda y: y[3].fill_(float("nan")))
    for bad in (exponent, sign, nan):
        assert disagreements("tp", [0, 1], ["ln"], table(x, bad), rtol=1e-3) == [
            "tp (within resilience.tp_rtol=0.001) replicas on global ranks [0, 1] differ in "
            "ln (suspect ranks 0, 1)"]
        rows = table(x, drift, bad, x)
        assert odd_within([r[0][0] for r in rows], [r[0][1] for r in rows], 1e-3) == [2]
    low = corrupt(lambda y: y.view(torch.int32)[7].bitwise_xor_(1))  # below the tolerance
    assert disagreements("tp", [0, 1], ["ln"], table(x, low), rtol=1e-3) == []


def test_one_changed_element_of_a_large_tp_replica_is_found_in_its_chunk():
    """A wpe-sized tensor (1024 x 768): a flipped exponent bit that scales one element by 16
    is diluted below tp_rtol in a sum over the whole tensor, but not in the sums of its
    4096-element chunks (as `ReplicaCheck.check` compares them); a rounding-level drift of
    every element (as between replicas computed with different kernels) passes."""
    torch.manual_seed(0)
    x = torch.randn(1024 * 768) * 0.02
    x[5000] = 0.02  # exponent 121: bit 25 (the exponent's 4) is clear, flipping it is x16
    bad = x.clone()
    bad.view(torch.int32)[5000].bitwise_xor_(1 << 25)
    assert bad[5000].item() == pytest.approx(0.32)
    drift = x * (1 + 2e-3 * torch.randn(x.numel()))

    def lines(other, chunk=TP_CHUNK):
        table = [sums_and_norms([t], x.device, chunk).tolist() for t in (x, other, x)]
        names = ["wpe"] * (x.numel() // chunk)
        return disagreements("tp", [0, 1, 2], names, table, rtol=1e-3)

    assert chunks_of(x) == 192 and len(sums_and_norms([x, x[:10]], x.device)) == 193
    assert lines(bad) == ["tp (within resilience.tp_rtol=0.001) replicas on global ranks "
                          "[0, 1, 2] differ in wpe (suspect rank 1)"]
    assert lines(bad, chunk=x.numel()) == []  # one sum over the tensor: missed
    assert lines(drift) == []


def test_stragglers_need_both_the_factor_and_the_floor():
    compute = [[0.10], [0.12], [0.50], [0.14], [0.0], [0.05]]
    assert find_slow(compute, [[0, 1, 2, 3]], 1.5, 0.1) == [(2, 0, 0.50, 0.12)]
    assert find_slow(compute, [[0, 1, 2, 3]], 1.5, 0.5) == []  # below the floor
    assert find_slow(compute, [[0, 1, 3]], 1.1, 0.0) == [(3, 0, 0.14, 0.12)]
    assert find_slow(compute, [[4, 5]], 1.5, 0.04) == [(5, 0, 0.05, 0.0)]
    assert find_slow([[0.0], [0.0]], [[0, 1]], 1.5, 0.0) == []  # equal is not slower


def test_peers_are_the_ranks_of_a_pipeline_stage():
    assert peer_groups(Topology(2, 2, 2, 0)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert peer_groups(Topology(1, 4, 1, 0)) == []  # one rank per stage: no peers
    assert peer_groups(Topology(1, 1, 3, 0)) == [[0, 1, 2]]


def test_compute_time_leaves_out_the_waits_in_collectives():
    clock = DeviceClock(torch.device("cpu"))
    waits = CollectiveWaits(clock)
    timers = StepTimers(torch.device("cpu"), waits)
    with timers.phase("grad_sync"):
        waits.timed(lambda: time.sleep(0.05))
        time.sleep(0.02)
    waits.timed(lambda: time.sleep(0.03))  # outside the phases: dropped
    compute, spent = timers.take_compute(), timers.take()
    assert spent["grad_sync"] >= 0.07
    assert 0.02 <= compute["grad_sync"] < 0.05, compute
    assert waits.calls == 2 and timers.take()["grad_sync"] == 0.0
