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

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.resilience.faults import HARDWARE_FAULT_EXIT
from megalite.resilience.replicas import fingerprint
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT, fit_to_exit

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


def _drill(rank, world, tiny_data, run_dir, overrides):
    """A run with a fault drill, through the CLI's fit_or_exit: the exit code and fault.json."""
    trainer = _trainer(tiny_data, run_dir, world, "resilience.allow_inject=true", *overrides)
    if trainer.engine.param_gather is not None:
        _defer_the_gather(trainer.engine.param_gather)
    code, fault = fit_to_exit(trainer, run_dir)
    return {"code": code, "step": trainer.step, "reruns": trainer.rerun.reruns,
            "injected": None if trainer.injector is None else trainer.injector.injected,
            "fault": fault,
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
    suspicious, execute = trainer.rerun.detector.suspicious, trainer.guard.execute

    def made_suspicious(values):
        return ["made suspicious by the test"] if trainer.step + 1 == 2 else suspicious(values)

    def nondeterministic_execute(execution, micro_batches, scale):
        loss, norm = execute(execution, micro_batches, scale)
        return (loss * (1 + 1e-3) if execution > 0 else loss), norm

    trainer.rerun.detector.suspicious = made_suspicious
    trainer.guard.execute = nondeterministic_execute
    code, fault = fit_to_exit(trainer, run_dir)
    log = Path(run_dir) / "resilience" / "nondeterminism.jsonl"
    return {"code": code, "step": trainer.step, "skipped": trainer.skipped_steps,
            "state": trainer.rerun.state_dict(), "fault": fault is not None,
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
        "persistent param": _drill(rank, world, tiny_data, f"{run_dir}/pp", [  # documents
            "zero=0", "resilience.rerun=on_nan", inject.format(1, "param", "persistent"),
            "train.attention_mask=document", "train.eos_loss=false"]),  # travel to the
        # other replica with its tokens, which recomputes them
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


SBATCH = Path(__file__).resolve().parents[3] / "scripts" / "slurm" / "pretrain.sbatch"


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


@pytest.mark.distributed
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
