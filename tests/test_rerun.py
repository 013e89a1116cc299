"""Rerun attribution (megalite.resilience.rerun) and its fault drills (resilience.inject): a
suspicious step is re-executed before its optimizer step; a transient fault is pinned on the
rank that computed wrong (fault.json, the hardware exit code), a persistent one on the replica
that recomputes another's micro-batches wrong, bad data is logged, skipped and counted."""
from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.inject import InjectSpec, parse_inject
from megalite.config.layout import Layout, validate
from megalite.config.schema import check_sections, load_config
from megalite.resilience.faults import HARDWARE_FAULT_EXIT, fit_or_exit
from megalite.resilience.inject import flip_bit
from megalite.resilience.inject_target import check_inject_target
from megalite.resilience.replicas import fingerprint
from megalite.resilience.spikes import SpikeDetector
from megalite.resilience.verdicts import (
    agree,
    cross_replica_verdict,
    nondeterministic,
    own_changes,
    transient_suspects,
)
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

POISON = 7  # a sequence of this token only: the data test makes its embedding NaN
POISONED_STEP = 2
STEPS = 3


def _trainer(tiny_data, run_dir, world, *extra):
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        f"train.max_steps={STEPS}", f"checkpoint.dir={run_dir}/ckpt", "log.peak_tflops=1",
        "resilience.check_every=0", "resilience.straggler_report_every=0", *extra])
    validate(cfg, world)
    return build_trainer(cfg, init_runtime(cfg), Path(run_dir))


def _exit_code(trainer):
    """Train through the CLI's fit_or_exit; its exit code (None: finished)."""
    try:
        fit_or_exit(trainer)
    except SystemExit as e:
        return e.code
    return None


def _drill(rank, world, tiny_data, run_dir, overrides):
    """A run with a fault drill, through the CLI's fit_or_exit: the exit code and fault.json."""
    trainer = _trainer(tiny_data, run_dir, world, "resilience.allow_inject=true", *overrides)
    if trainer.engine.param_gather is not None:
        _defer_the_gather(trainer.engine.param_gather)
    code = _exit_code(trainer)
    fault = Path(run_dir) / "resilience" / "fault.json"
    return {"code": code, "step": trainer.step, "reruns": trainer.rerun.reruns,
            "injected": None if trainer.injector is None else trainer.injector.injected,
            "fault": json.loads(fault.read_text()) if fault.exists() else None,
            "published": sorted(p.name for p in (Path(run_dir) / "ckpt").glob("step_*"))}


def _defer_the_gather(gather):
    """parallel.overlap_param_gather's gather, started only when first waited for (as a slow
    network would deliver it): a parameter flipped before that wait is overwritten by the
    gather unless the drill waits for the parameters first."""
    launch, wait, deferred = gather.launch, gather.wait, []

    def deferred_wait(buckets=None):
        if deferred:
            launch(*deferred.pop())
        wait(buckets)

    gather.launch, gather.wait = (lambda *args: deferred.append(args)), deferred_wait


def _poisoned(rank, world, tiny_data, run_dir, overrides, replica=1):
    """Every rank's embedding turns a micro-batch with a sequence of POISON tokens only into
    NaN (the data's fault, wherever it is computed); DP replica 1's step POISONED_STEP gets
    such a sequence."""
    trainer = _trainer(tiny_data, run_dir, world, "log.every=1", *overrides)
    chunk = trainer.model.chunks[0]
    if chunk.first:
        chunk.transformer.wte.register_forward_hook(
            lambda module, args, out: out * math.nan if (args[0] == POISON).all(0).any()
            else out)
    next_step, seen = trainer.batches.next_step, {}

    def poisoned_next_step(*args):
        micro_batches = next_step(*args)
        if trainer.step + 1 == POISONED_STEP:
            seen["samples"] = trainer.batches.last_samples
            if trainer.topo.coords.dp_rank == replica and micro_batches[1][0] is not None:
                micro_batches[1][0][0, :] = POISON
        return micro_batches

    trainer.batches.next_step = poisoned_next_step
    records = trainer.fit()
    masters = [piece.detach() for piece, _, _ in trainer.engine.main_params]  # any zero stage
    skips = Path(run_dir) / "resilience" / "data_skips.jsonl"
    unresolved = Path(run_dir) / "resilience" / "unresolved.jsonl"
    resumed = None
    if trainer.rerun is not None:  # the last step's checkpoint carries the rerun statistics
        again = _trainer(tiny_data, run_dir, world, "checkpoint.resume=auto", *overrides)
        resumed = again.rerun.state_dict() == trainer.rerun.state_dict()
    return {"losses": [r["loss"] for r in records], "skipped": trainer.skipped_steps,
            "rerun_state": None if trainer.rerun is None else trainer.rerun.state_dict(),
            "resumed_state_equal": resumed,
            "data_skips": None if trainer.rerun is None else trainer.rerun.data_skips,
            "fingerprint": fingerprint(masters, torch.device("cpu")).tolist(),
            "samples": seen["samples"], "dp_rank": trainer.topo.coords.dp_rank,
            "log": [json.loads(line) for line in skips.read_text().splitlines()]
            if skips.exists() else [],
            "unresolved": [json.loads(line) for line in unresolved.read_text().splitlines()]
            if unresolved.exists() else []}


def _nondeterministic(rank, world, tiny_data, run_dir):
    """Step 2 is made suspicious, and every rank's re-execution of it computes a loss 1e-3
    apart (relative) from its first execution's, as kernels with atomics in the backward
    would: ranks of both DP replicas change their own results at once."""
    trainer = _trainer(tiny_data, run_dir, world, "zero=1", "resilience.rerun=on_nan")
    suspicious, execute = trainer.rerun.detector.suspicious, trainer._execute

    def made_suspicious(values):
        return ["made suspicious by the test"] if trainer.step + 1 == 2 else suspicious(values)

    def nondeterministic_execute(execution, micro_batches, scale):
        loss, norm = execute(execution, micro_batches, scale)
        return (loss * (1 + 1e-3) if execution > 0 else loss), norm

    trainer.rerun.detector.suspicious = made_suspicious
    trainer._execute = nondeterministic_execute
    code = _exit_code(trainer)
    log = Path(run_dir) / "resilience" / "nondeterminism.jsonl"
    return {"code": code, "step": trainer.step, "skipped": trainer.skipped_steps,
            "state": trainer.rerun.state_dict(),
            "fault": (Path(run_dir) / "resilience" / "fault.json").exists(),
            "log": [json.loads(line) for line in log.read_text().splitlines()]
            if log.exists() else []}


def _all_runs(rank, world, tiny_data, run_dir):
    inject = "resilience.inject=rank:{}/step:2/target:{}/kind:{}"  # the unquoted form
    return {
        "transient param": _drill(rank, world, tiny_data, f"{run_dir}/tp", [  # the flip
            "zero=1", "parallel.overlap_param_gather=true",  # waits for the params' gather
            "resilience.rerun=on_nan", inject.format(0, "param", "transient")]),  # rank 1's
        # shard of the bucket (rank 0's copy of it is gathered from rank 1)
        "transient grad": _drill(rank, world, tiny_data, f"{run_dir}/tg", [
            "zero=0", "resilience.rerun=on_spike", "resilience.spike_warmup=1",
            inject.format(0, "grad", "transient")]),
        "persistent param": _drill(rank, world, tiny_data, f"{run_dir}/pp", [
            "zero=0", "resilience.rerun=on_nan", inject.format(1, "param", "persistent")]),
        "data": _poisoned(rank, world, tiny_data, f"{run_dir}/data",
                          ["zero=1", "resilience.rerun=on_nan"]),
        "skipping": _poisoned(rank, world, tiny_data, f"{run_dir}/skip", ["zero=1"]),
        "dp1": _poisoned(rank, world, tiny_data, f"{run_dir}/dp1",
                         ["pp=2", "resilience.rerun=on_nan"], replica=0),
        "nondeterministic": _nondeterministic(rank, world, tiny_data, f"{run_dir}/nd"),
    }


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    return run_ranks(_all_runs, 2, args=(tiny_data, str(tmp_path_factory.mktemp("rerun"))),
                     timeout_s=300)


@pytest.mark.distributed
@pytest.mark.parametrize("label, rank, kind", [("transient param", 0, "transient"),
                                               ("transient grad", 0, "transient"),
                                               ("persistent param", 1, "persistent")])
def test_an_injected_fault_is_pinned_on_its_rank_and_exits_with_the_hardware_code(
        runs, label, rank, kind):
    """Rank `rank`'s device computes wrong at step 2 (a flipped exponent bit in its LayerNorm
    weight — with the parameter gather overlapped and deferred to the forward's first wait, so
    a flip that did not wait for it would be overwritten —, or in its local gradient before
    the DP reduction): the step is re-executed before
    its optimizer step, fault.json names that rank, the step and the kind, and every rank exits
    with HARDWARE_FAULT_EXIT. A transient fault does not reproduce on re-execution; a
    persistent one does, and the other replica's recomputation of the same micro-batches
    tells it from the data. Nothing of step 2 is published."""
    for res in runs:
        run = res[label]
        assert run["code"] == HARDWARE_FAULT_EXIT, run
        assert run["step"] == 1 and run["reruns"] == 1, run  # step 2 was never completed
        fault = run["fault"]
        assert (fault["rank"], fault["step"], fault["kind"]) == (rank, 2, kind), fault
        assert [s["rank"] for s in fault["suspects"]] == [rank], fault
        assert fault["gpu"] is None and fault["node"], fault
        assert run["published"] == [], run
    injected = runs[rank][label]["injected"]
    assert injected == (1 if kind == "transient" else 3), injected  # 3: all executions
    assert runs[1 - rank][label]["injected"] == 0


@pytest.mark.distributed
def test_bad_data_is_logged_skipped_and_the_run_equals_one_that_skips_the_batch(runs):
    """DP replica 1's micro-batch of step 2 makes the loss NaN on any device: the rerun
    reproduces it and replica 0's recomputation too, so the data is blamed: replica 1's
    samples of that step are logged, the batch is skipped and counted, and the run goes on to
    the end equal — losses and parameters, bitwise — to the run without rerun that skips
    the non-finite step."""
    for res in runs:
        data, skipping = res["data"], res["skipping"]
        assert data["skipped"] == 1 and data["data_skips"] == 1, data
        assert data["losses"] == skipping["losses"], (data["losses"], skipping["losses"])
        assert data["losses"][POISONED_STEP - 1] is None and len(data["losses"]) == STEPS
        assert all(x is not None for i, x in enumerate(data["losses"]) if i != 1)
        assert data["fingerprint"] == skipping["fingerprint"]
        assert skipping["skipped"] == 1 and skipping["data_skips"] is None
        state = data["rerun_state"]  # 3 applied steps recorded; the bad batch was not
        assert state["detector"]["recorded"] == STEPS - 1 and state["data_skips"] == 1, state
        assert len(state["detector"]["history"]["grad_norm"]) == STEPS - 1, state
        assert data["resumed_state_equal"] is True  # through the checkpoint's state_dict()
    replica1 = next(r["data"] for r in runs if r["data"]["dp_rank"] == 1)
    log = runs[0]["data"]["log"]
    assert len(log) == 1 and log[0]["step"] == POISONED_STEP and log[0]["replicas"] == [1], log
    assert log[0]["samples"] == {"1": [list(s) for s in replica1["samples"]]}, log
    assert len(log[0]["samples"]["1"]) == 4  # replica 1's half of the global batch of 8


@pytest.mark.distributed
def test_with_one_replica_a_reproduced_step_is_skipped_as_unresolved(runs):
    """pp 2, dp 1: the re-execution reproduces the poisoned step and no other replica can
    recompute it, so it is neither blamed on the data nor on a device: logged as unresolved
    (a restart excluding the node would tell), skipped and counted; the run goes on."""
    for res in runs:
        run = res["dp1"]
        assert run["skipped"] == 1 and run["data_skips"] == 0 and run["log"] == [], run
        assert run["rerun_state"]["unresolved"] == 1, run
        assert run["losses"][POISONED_STEP - 1] is None, run["losses"]
        assert sum(x is not None for x in run["losses"]) == STEPS - 1
    entry = runs[0]["dp1"]["unresolved"]
    assert len(entry) == 1 and entry[0]["step"] == POISONED_STEP
    assert [list(s) for s in runs[0]["dp1"]["samples"]] == entry[0]["samples"]


@pytest.mark.distributed
def test_a_rerun_that_differs_on_every_replica_is_non_determinism_not_a_fault(runs):
    """Every rank's re-execution differs from its first execution (beyond
    resilience.rerun_tolerance): no device changes another replica's own results, so it is
    the kernels' non-determinism: no fault.json, no hardware exit; logged with the ranks and
    the difference, the batch skipped and counted, and the run goes on to its last step."""
    for res in runs:
        run = res["nondeterministic"]
        assert run["code"] is None and not run["fault"] and run["step"] == STEPS, run
        assert run["skipped"] == 1, run
        assert (run["state"]["reruns"], run["state"]["nondeterministic"]) == (1, 1), run
    log = runs[0]["nondeterministic"]["log"]
    assert len(log) == 1 and log[0]["step"] == 2 and log[0]["ranks"] == [0, 1], log
    assert log[0]["largest_relative_difference"] == pytest.approx(1e-3, rel=1e-2), log


# --- pure logic, no ranks --------------------------------------------------------------


def test_spikes_are_judged_against_the_running_median_after_the_warmup():
    d = SpikeDetector(spikes=True, factor=3.0, window=3, warmup=2)
    assert d.suspicious({"grad_norm": 100.0}) == []  # nothing recorded: no median yet
    d.record({"grad_norm": 1.0, "loss": 5.0})
    assert d.suspicious({"grad_norm": 100.0}) == []  # in the warm-up
    d.record({"grad_norm": 2.0, "loss": 5.0})
    assert d.suspicious({"grad_norm": 4.4, "loss": 5.0}) == []  # 4.4 <= 3 x median 1.5
    assert len(d.suspicious({"grad_norm": 4.6})) == 1
    for v in (10.0, 10.0, 10.0):  # the window keeps the last 3: median 10
        d.record({"grad_norm": v})
    assert d.suspicious({"grad_norm": 29.0}) == [] and d.suspicious({"grad_norm": 31.0})
    assert d.suspicious({"loss": float("nan")}) == ["loss nan"]
    nan_only = SpikeDetector(spikes=False, factor=3.0, window=3, warmup=None)
    nan_only.record({"grad_norm": 1.0})
    assert nan_only.suspicious({"grad_norm": 1e9}) == []
    assert nan_only.suspicious({"grad_norm": float("inf")}) == ["grad_norm inf"]


def test_the_spike_statistics_survive_a_state_dict_round_trip():
    a = SpikeDetector(spikes=True, factor=2.0, window=4, warmup=3)
    for v in (1.0, 2.0, 3.0, 4.0, 5.0):
        a.record({"grad_norm": v, "loss": v + 1})
    b = SpikeDetector(spikes=True, factor=2.0, window=4, warmup=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as meta.json carries it
    assert b.state_dict() == a.state_dict()
    for probe in ({"grad_norm": 7.1}, {"grad_norm": 6.9}, {"loss": 9.5}):
        assert b.suspicious(probe) == a.suspicious(probe)
    assert a.suspicious({"grad_norm": 7.1}) and not a.suspicious({"grad_norm": 6.9})


def test_a_transient_fault_is_pinned_on_the_ranks_whose_own_results_changed():
    nan = math.nan
    first = [[2.0, 1.0, 5.0], [nan, nan, nan], [2.5, 1.5, 5.0]]
    second = [[2.0, 1.0, 4.0], [2.2, 1.2, 4.0], [2.5, 1.5, 4.0]]
    assert transient_suspects(first, second, 0.0) == [1]  # the reduced grads changed on all
    assert transient_suspects(first, first, 0.0) == []  # NaN reproduced is no change
    only_reduced = [[2.0, 1.0, 5.0], [2.2, 1.2, 9.0]]
    assert transient_suspects(only_reduced, [[2.0, 1.0, 5.0], [2.2, 1.2, 5.0]], 0.0) == [1]
    assert agree(1.0, 1.0 + 1e-9, 1e-6) and not agree(1.0, 1.0 + 1e-9, 0.0)
    assert not agree(math.inf, 3.0, 1e-5) and agree(math.inf, math.inf, 1e-5)


def test_own_changes_in_two_replicas_are_non_determinism_and_in_one_a_fault():
    first = [[2.0, 1.0, 5.0], [2.5, 1.5, 5.0], [3.0, 1.0, 5.0], [3.5, 1.5, 5.0]]
    rounding = [[2.0 * (1 + 1e-4), 1.0, 5.1], [2.5, 1.5, 5.1], [3.0, 1.0, 5.1],
                [3.5, 1.5 * (1 - 1e-4), 5.1]]
    replicas = [[0, 1], [2, 3]]  # tp 2 x dp 2
    changed = own_changes(first, rounding, 1e-5)
    assert changed == [0, 3] and nondeterministic(changed, replicas)
    assert not nondeterministic(changed, replicas, shards_parameters=True)  # zero 3 gathers
    assert own_changes(first, rounding, 1e-3) == []  # within a looser tolerance: no change
    fault = [[math.nan, 1.0, 5.1], [2.5, 2.0, 5.1], [3.0, 1.0, 5.1], [3.5, 1.5, 5.1]]
    assert not nondeterministic(own_changes(first, fault, 1e-5), replicas)  # one replica
    assert transient_suspects(first, fault, 1e-5) == [0, 1]


def test_the_cross_replica_recomputation_tells_a_persistent_fault_from_the_data():
    nan, ok = math.nan, [2.0, 1.0, 0.0]
    replicas = [[0], [1]]
    # the data: both replicas reproduce each other's results, NaN included
    assert cross_replica_verdict([ok, [nan, nan, 0]], [[nan, nan, 0], ok], replicas, 0) == []
    # replica 1 computes NaN on any data, replica 0 computes replica 1's data fine
    assert cross_replica_verdict([ok, [nan, nan, 0]], [[3.0, 1.0, 0], [nan, nan, 0]],
                                 replicas, 0) == [1]
    # three replicas, replica 2 wrong on everything it computes (finite): the one in two pairs
    first = [[1.0, 1, 0], [2.0, 1, 0], [3.5, 1, 0]]
    recomputed = [[3.0, 1, 0], [1.0, 1, 0], [2.5, 1, 0]]  # replica d + 1 recomputes d's data
    assert cross_replica_verdict(first, recomputed, [[0], [1], [2]], 0) == [2]
    # two replicas, finite and disagreeing both ways: either may be wrong, both are named
    assert cross_replica_verdict([[1.0, 1, 0], [2.0, 1, 0]], [[2.5, 1, 0], [1.5, 1, 0]],
                                 replicas, 0) == [0, 1]


def test_flip_bit_flips_one_bit_and_back():
    x = torch.ones(4)
    flip_bit(x, 2, 30)
    assert math.isinf(x[2].item()) and x[[0, 1, 3]].tolist() == [1.0, 1.0, 1.0]
    flip_bit(x, 2, 30)
    assert x.tolist() == [1.0] * 4
    flip_bit(x, 0, 31)  # the sign bit
    assert x[0].item() == -1.0


def test_the_drill_spec_parses_with_defaults():
    assert parse_inject("rank=1, step=3") == InjectSpec(rank=1, step=3)
    assert parse_inject("rank:1/step:3") == InjectSpec(rank=1, step=3)
    spec = parse_inject("rank=0,step=2,target=grad,kind=persistent,tensor=x,index=5,bit=3")
    assert (spec.target, spec.kind, spec.tensor, spec.index, spec.bit) == \
        ("grad", "persistent", "x", 5, 3)


@pytest.mark.parametrize("overrides, key", [
    (["resilience.spike_factor=1.0"], "resilience.spike_factor"),
    (["resilience.spike_factor=0.5"], "resilience.spike_factor"),
    (["resilience.rerun=on_spike"], "resilience.spike_warmup"),
    (["resilience.rerun=always"], "resilience.rerun"),
    (["resilience.rerun=on_spike", "resilience.spike_warmup=0"], "resilience.spike_warmup"),
    (["resilience.rerun_tolerance=-1"], "resilience.rerun_tolerance"),
    (["resilience.inject='rank=1,step=2'"], "resilience.inject"),  # not enabled
    (["resilience.inject='rank=1'", "resilience.allow_inject=true"], "resilience.inject"),
    (["resilience.inject='rank=1,step=2,target=optimizer'", "resilience.allow_inject=true"],
     "resilience.inject"),
])
def test_bad_rerun_and_inject_values_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}="):
        check_sections(load_config(overrides))


@pytest.mark.parametrize("inject, what", [
    ("rank=1,step=301", "beyond train.max_steps=300"),
    ("rank=2,step=3", "world has 2 ranks"),
])
def test_a_drill_the_run_cannot_reach_is_refused_before_launch(inject, what):
    cfg = load_config([f"resilience.inject='{inject}'", "resilience.allow_inject=true",
                       "train.max_steps=300"])
    with pytest.raises(ConfigError, match=r"^resilience\.inject=") as e:
        validate(cfg, 2)
    assert what in str(e.value)
    cfg = load_config(["resilience.inject='rank=1,step=300'", "resilience.allow_inject=true",
                       "train.max_steps=300", "resilience.rerun=on_spike",
                       "resilience.spike_warmup=10"])
    validate(cfg, 2)  # the last step is a step the run reaches


# --- scripts/slurm/pretrain.sbatch on a fault ----------------------------------------------

SBATCH = Path(__file__).resolve().parents[1] / "scripts" / "slurm" / "pretrain.sbatch"


def _sbatch(tmp_path: Path, srun_body: str, nodes: str = "gpu07\ngpu08"):
    """The script with a fake srun (`srun_body`) and scontrol (`nodes`) first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("srun", srun_body), ("scontrol", f"printf '{nodes}\\n'")):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "RUN_DIR": str(tmp_path / "run"), "MEGALITE_DIR": str(tmp_path),
           "FAULT_POLL_S": "0.1", "HEAD_NODE": "gpu07"}
    return subprocess.run(["/bin/bash", str(SBATCH), "model=tiny"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)


def test_sbatch_stops_the_job_step_on_a_fault_and_exits_with_the_hardware_code(tmp_path):
    """The workers' fault.json appears while the step runs: the script stops the step (the
    fake srun would run 60 s more, as torchrun restarting would) and exits 75, naming the
    node to exclude. A later job on an allocation with that node refuses to start; one
    without it moves the file aside and runs."""
    fault = tmp_path / "run" / "resilience" / "fault.json"
    t0 = time.monotonic()
    proc = _sbatch(tmp_path, f"mkdir -p {fault.parent}\n"
                   f"echo '{{\"rank\": 3, \"node\": \"gpu08\"}}' > {fault}\nexec sleep 60")
    assert proc.returncode == HARDWARE_FAULT_EXIT, proc.stderr
    assert time.monotonic() - t0 < 20
    assert "sbatch --exclude=gpu08" in proc.stderr, proc.stderr
    again = _sbatch(tmp_path, "exit 0")
    assert again.returncode == HARDWARE_FAULT_EXIT and "node gpu08" in again.stderr
    assert fault.exists()
    elsewhere = _sbatch(tmp_path, "exit 0", nodes="gpu01\ngpu02")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert not fault.exists() and len(list(fault.parent.glob("fault-*.json"))) == 1


def test_an_overflow_the_loss_scale_absorbs_is_not_suspicious():
    """fp16: a non-finite norm while the dynamic scale can still shrink is the scale's to
    absorb (no rerun); at the scale's floor it is suspicious."""
    from types import SimpleNamespace

    from megalite.config.sections import ResilienceConfig
    from megalite.resilience.rerun import RerunAttribution
    from megalite.train.loss_scale import LossScaler

    scaler = LossScaler(scale=1024.0, min_scale=1.0)
    engine = SimpleNamespace(grad_launching=[])
    rerun = RerunAttribution(ResilienceConfig(rerun="on_nan"), topo=None,
                             device=torch.device("cpu"), engine=engine, rng=None,
                             run_dir=Path("."), loss_scaler=scaler)
    assert engine.grad_launching == [rerun._add_local_grad]
    called = []
    rerun._rerun = lambda *args: called.append(args) or True
    inf, loss = torch.tensor(math.inf), torch.tensor(2.0)
    assert rerun.judge(3, loss, inf, [], [], None) is False and not called
    assert rerun.judge(3, loss, torch.tensor(1.0), [], [], None) is False and not called
    scaler.scale = scaler.min_scale  # at the floor: the run itself is non-finite
    assert rerun.judge(3, loss, inf, [], [], None) is True and len(called) == 1
    assert rerun.detector.recorded == 1  # only the finite step entered the statistics


@pytest.mark.parametrize("overrides, what", [
    (["precision=bf16", "resilience.inject=rank:1/step:3/bit:30"],
     "bit=30 is outside the 16-bit elements of the bf16 parameters: use a bit < 16"),
    (["pp=2", "resilience.inject=rank:1/step:3"],  # the default tensor: block 0's ln_1
     "rank 1 holds no parameter transformer.h.0.ln_1.weight"),
    (["tp=2", "resilience.inject=rank:1/step:3/tensor:transformer.h.1.mlp.c_fc.weight/"
      "index:32768"], "has 32768 elements: use an index < 32768"),  # its TP shard: 512 x 128 / 2
    (["resilience.inject=rank:0/step:3/target:grad/bit:32"], "32-bit elements of the fp32"),
])
def test_a_drill_outside_the_rank_s_tensor_is_refused_before_launch(overrides, what):
    """A drill the rank could not apply (a bit beyond the element's width, a tensor of another
    pipeline stage, an element beyond the rank's TP shard) is refused by the launch's checks,
    naming the key: not by a crash of that rank at the drill's step."""
    cfg = load_config([*overrides, "resilience.allow_inject=true", "train.max_steps=5"])
    with pytest.raises(ConfigError, match=r"^resilience\.inject=") as e:
        _launch_checks(cfg, 2)
    assert what in str(e.value)
    fixed = [o.replace("/bit:30", "").replace("/bit:32", "").replace("index:32768", "index:0")
             for o in overrides]
    if "pp=2" not in overrides:  # the same drill within the rank's tensor is accepted
        _launch_checks(load_config([*fixed, "resilience.allow_inject=true",
                                    "train.max_steps=5"]), 2)


def _launch_checks(cfg, world: int) -> None:
    """What the preflight checks of a drill: the configuration for the world
    (`validate`), then the drill's tensor on its rank's stage (`check_inject_target`)."""
    validate(cfg, world)
    check_inject_target(cfg, Layout.from_config(cfg, world))


@pytest.mark.parametrize("tensor, held", [
    ("transformer.h.4.attn.c_attn.weight", True), ("transformer.h.5.mlp.c_proj.bias", True),
    ("transformer.h.6.ln_1.weight", False), ("transformer.h.1.ln_1.weight", False),
    ("transformer.ln_f.weight", False), ("transformer.wte.weight", False),
])
def test_a_zb_v_drill_is_checked_against_the_blocks_of_the_v(tensor, held):
    """zb-v at pp=2 with 8 blocks: rank 1 holds slices 1 and 2 of the V (blocks 2-3 and 4-5),
    rank 0 slices 0 and 3 (blocks 0-1 and 6-7, the embeddings, ln_f and the head). A drill
    on rank 1 is accepted for a tensor of its blocks and refused, naming the key, for one of
    rank 0's."""
    cfg = load_config(["pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2",
                       "model.n_layer=8", f"resilience.inject=rank:1/step:3/tensor:{tensor}",
                       "resilience.allow_inject=true", "train.max_steps=5"])
    if held:
        _launch_checks(cfg, 2)
        return
    with pytest.raises(ConfigError, match=rf"^resilience\.inject=.*rank 1 holds no parameter "
                       rf"{tensor}"):
        _launch_checks(cfg, 2)


def test_a_parameter_drill_under_zero3_is_refused_before_launch():
    cfg = load_config(["resilience.inject=rank:0/step:1", "resilience.allow_inject=true",
                       "zero=3"])
    with pytest.raises(ConfigError, match=r"^resilience\.inject=.*zero=3"):
        validate(cfg, 2)
    validate(load_config(["resilience.inject=rank:0/step:1/target:grad",
                          "resilience.allow_inject=true", "zero=3"]), 2)


def test_a_batch_skipped_as_bad_data_is_no_good_step_for_the_loss_scale():
    """fp16: the dynamic scale grows after `window` good steps in a row; a finite step that
    resilience.rerun skipped as bad data is not one of them (nor an overflow)."""
    from types import SimpleNamespace

    from megalite.train.loss_scale import LossScaler
    from megalite.train.step_guard import count_skipped

    scaler = LossScaler(scale=1024.0, min_scale=1.0, window=2)
    trainer = SimpleNamespace(loss_scaler=scaler, skipped_steps=0, bad_in_a_row=0, step=1,
                              cfg=SimpleNamespace(train=SimpleNamespace(max_bad_steps=5)))
    count_skipped(trainer, finite=True)
    count_skipped(trainer, finite=True, data_skip=True)
    assert (scaler.scale, scaler.good_steps) == (1024.0, 1)
    assert (trainer.skipped_steps, trainer.bad_in_a_row) == (1, 1)
    count_skipped(trainer, finite=True)  # the second good step: the scale grows
    assert (scaler.scale, scaler.good_steps, trainer.bad_in_a_row) == (2048.0, 0, 0)


def test_a_run_dir_with_a_fault_verdict_is_refused_at_start(tmp_path, capsys):
    """scripts/pretrain.py's first check (`refuse_after_fault`): while
    <run dir>/resilience/fault.json exists the process exits with HARDWARE_FAULT_EXIT, naming
    the file, the fault and how to clear it; once moved aside it starts."""
    from megalite.resilience.faults import refuse_after_fault, write_fault

    refuse_after_fault(tmp_path)  # no verdict: nothing happens
    path = write_fault(tmp_path, {"step": 5, "kind": "transient", "rank": 3, "node": "gpu08",
                                  "gpu": 2})
    with pytest.raises(SystemExit) as e:
        refuse_after_fault(tmp_path)
    assert e.value.code == HARDWARE_FAULT_EXIT
    message = capsys.readouterr().err
    assert f"{path} exists" in message and "rank 3 (node gpu08, GPU 2)" in message, message
    assert f"mv {path} " in message
    path.rename(path.with_name("fault-cleared.json"))
    refuse_after_fault(tmp_path)


def test_rerun_deterministic_switches_a_cuda_run_to_deterministic_algorithms(monkeypatch):
    """resilience.rerun_deterministic's switch (`use_deterministic_kernels`): on a CUDA device
    torch's deterministic algorithms (warn-only), no filling of uninitialised memory; nothing
    on a CPU (its kernels are deterministic). cuBLAS's fixed workspace is set at launch
    (`cublas_workspace_env`, from init_runtime) with rerun on, unless the user set it."""
    from types import SimpleNamespace

    from megalite.resilience.rerun import cublas_workspace_env, use_deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cublas_workspace_env(SimpleNamespace(rerun="off", rerun_deterministic=True))
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's stays
    cublas_workspace_env(SimpleNamespace(rerun="on_nan", rerun_deterministic=True))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    cublas_workspace_env(SimpleNamespace(rerun="on_nan", rerun_deterministic=True))
    fill = torch.utils.deterministic.fill_uninitialized_memory
    assert not use_deterministic_kernels(torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        assert use_deterministic_kernels(torch.device("cuda"))  # sets flags only: no GPU needed
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.utils.deterministic.fill_uninitialized_memory is False
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill
