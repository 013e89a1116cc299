"""The placement planner (megalite/plan/memory.py) against what runs measure: parameters per rank,
model-state bytes and every group's wire bytes per step from real gloo runs, activation bytes
from the tensors autograd saves. Three of the 8-rank runs also score HellaSwag, against the
serial run (tests/unit/eval/test_hellaswag.py)."""
from __future__ import annotations

import pytest
import torch

from megalite.config.layout import Layout
from megalite.config.schema import load_config
from megalite.plan.memory import make_plan
from tests.conftest import TINY
from tests.integration.model.test_moe_layouts import MOE
from tests.layouts import FP32_NO_DROPOUT, train_layouts
from tests.unit.eval.test_hellaswag import hellaswag_overrides, serial_trainer

LAYOUTS = [
    ["tp=2", "pp=2", "zero=1", "sp=true"],
    ["tp=2", "pp=2", "zero=3"],
    ["tp=2", "zero=2", "train.recompute=true"],
    ["tp=2", "pp=2", "sp=true", "train.recompute=true"],
    ["zero=3", "train.global_batch_size=16"],
    ["tp=2", "sp=true", "train.recompute=true", "train.recompute_layers=1"],
    ["tp=2", "pp=2", "zero=3", "parallel.virtual_stages=2", "model.n_layer=4"],
    ["tp=2", "pp=2", "zero=1", "sp=true", "parallel.virtual_stages=2", "model.n_layer=4"],
]


def group_wire_bytes(step_comm: dict, group: str) -> float:
    return sum(v["wire_bytes"] for k, v in step_comm.items() if k.startswith(group + "/"))


# Runs that also score HellaSwag (random weights of their n_layer, before their steps):
# tp2 pp2 dp2 zero3; with virtual stages; with SP and virtual stages (test_hellaswag_*).
HELLASWAG_RUNS = {1: 2, 6: 4, 7: 4}


@pytest.fixture(scope="module")
def measured(tiny_data, tmp_path_factory):
    common = [f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8"]
    scores = tmp_path_factory.mktemp("hellaswag")
    runs = [common + layout + (hellaswag_overrides(scores, tiny_data, HELLASWAG_RUNS[i])
                               if i in HELLASWAG_RUNS else [])
            for i, layout in enumerate(LAYOUTS)]
    return runs, train_layouts(tmp_path_factory.mktemp("plan"), 8, runs, steps=2)


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_plan_matches_measured_state_and_traffic(measured, index):
    runs, results = measured
    cfg = load_config(TINY + FP32_NO_DROPOUT + runs[index])
    plan = make_plan(cfg, Layout.from_config(cfg, 8, "cpu"))
    for res in results[index]:
        stage = plan.stages[res["coords"][1]]
        assert res["local_numel"] == stage.params
        for kind, got in res["bytes"].items():  # flat buffers pad each bucket to N elements
            assert got == pytest.approx(stage.bytes[kind], rel=0.01), (runs[index], kind)
        # zero 2/3's staging as the engine declares it (its bound), bucket for bucket; what
        # is alive when: the peak tests below
        assert res["grad_staging"] == stage.declared_staging, runs[index]
    # Traffic: the mean over a stage's ranks (with SP, how many TP-replicated gradient elements
    # fall into a rank's ZeRO range differs between DP ranks; the plan counts R/N for each).
    for stage in plan.stages:
        ranks = [r for r in results[index] if r["coords"][1] == stage.stage]
        for group in ("tp", "pp", "dp", "embedding"):
            got = sum(group_wire_bytes(r["step_comm"], group) for r in ranks) / len(ranks)
            assert got == pytest.approx(stage.comm[group], rel=0.02, abs=64), \
                (runs[index], stage.stage, group, [r["step_comm"] for r in ranks])
    if cfg.tp == 2 and cfg.pp == 2 and not cfg.sp:  # scatter/gather: 1/tp of each transfer
        t = cfg.train
        activation = 4 * t.seq_len * t.micro_batch_size * cfg.model.n_embd  # fp32 [s, b, h]
        transfers = cfg.parallel.virtual_stages * 2 - 1  # per micro-batch: F out + B out
        m = t.global_batch_size // (t.micro_batch_size * 2)
        for res in results[index]:
            sent = group_wire_bytes(res["step_comm"], "pp")
            assert sent == m * transfers * activation / cfg.tp, (runs[index], sent)


@pytest.mark.distributed
@pytest.mark.parametrize("index", sorted(HELLASWAG_RUNS))
def test_hellaswag_scores_equal_the_serial_run(measured, index, tiny_data, tmp_path):
    """Every rank of the 8-rank run holds every ending's loss as the serial run computes it on
    the same weights (fp32 tolerance; the serial scoring is transformers', test_hellaswag.py),
    and the same acc and acc_norm."""
    runs, results = measured
    scoring = [o for o in runs[index] if o.startswith(("init_from=", "eval.", "train.eval_"))]
    serial = serial_trainer(tiny_data, tmp_path, *scoring,
                            f"model.n_layer={HELLASWAG_RUNS[index]}").evaluate_hellaswag()
    for rank in results[index]:
        scores = rank["hellaswag"]
        assert torch.equal(scores.counts, serial.counts)
        torch.testing.assert_close(scores.losses, serial.losses, rtol=1e-5, atol=1e-5)
        assert (scores.acc, scores.acc_norm) == (serial.acc, serial.acc_norm), runs[index]


def run_plan(*args):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "scripts" / "plan.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=120)


def run_plan_here(*args):
    """What the script runs (megalite.cli.plan.main), in this process: no interpreter start."""
    import contextlib
    import io
    from types import SimpleNamespace

    from megalite.cli.plan import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.mark.distributed
@pytest.mark.slow
def test_plan_script_reports_checks_and_flags_memory():
    ok = run_plan("--world-size", "16", "model=gpt2-large", "tp=4", "pp=2", "zero=1", "sp=true",
                  "train.seq_len=1024", "train.micro_batch_size=4", "train.global_batch_size=256")
    assert ok.returncode == 0, ok.stderr
    assert "tp=4 pp=2 dp=2 zero=1" in ok.stdout and "placement over DP: P replicated" in ok.stdout
    assert len([line for line in ok.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]) == 2
    # the rest in this process (the script above runs the same main)
    bad = run_plan_here("--world-size", "16", "model=gpt2-xl", "tp=8", "pp=2")
    assert bad.returncode == 2 and "tp=8: must divide model.n_head=25" in bad.stderr
    empty = run_plan_here("--world-size", "0")
    assert empty.returncode == 2 and "world size=0: needs at least one rank" in empty.stderr
    # gpt2-xl at micro-batch 24 did not fit one 80 GB H100 (scripts/bench.py train), 16 did
    big = ["--world-size", "1", "--gpu-memory-gib", "80", "model=gpt2-xl", "train.seq_len=1024"]
    over = run_plan_here(*big, "train.micro_batch_size=24", "train.global_batch_size=48")
    assert over.returncode == 3 and "stage 0 needs about" in over.stderr
    fits = run_plan_here(*big, "train.micro_batch_size=16", "train.global_batch_size=64")
    assert fits.returncode == 0, fits.stderr


# The plan's peak against the peak live bytes of real training steps on 2 gloo ranks (one
# spawn, the runs in turn; in-process runs: tests/unit/plan/test_plan.py): (run, the moment each
# pipeline stage peaks at).
SPAWNED_PEAKS = [
    # activations, 1F1B: stage 0 holds two micro-batches and the transfers gloo keeps
    (["pp=2", "model.n_layer=4", "train.micro_batch_size=8", "train.global_batch_size=32"],
     ["backward", "loss backward"]),
    # ZeRO-2's staging: one bucket of the whole model, reduce-scattered with gloo's copy
    (["zero=2", "model.n_embd=256", "train.micro_batch_size=1", "train.seq_len=8",
      "train.global_batch_size=4"], ["backward"]),
    # ZeRO-3 over DP: the gathered units beside the activations and the loss
    (["zero=3", "model.n_layer=4", "train.micro_batch_size=8"], ["loss backward"]),
    # EP folded over TP: the routed experts whole on each rank's own tokens, the shared
    # experts TP-split, the first block dense
    (MOE + ["tp=2", "sp=true", "ep=2", "model.n_layer=4", "train.micro_batch_size=8",
            "train.global_batch_size=16", "zero=1", "model.moe.shared_experts=1",
            "model.moe.first_dense_layers=1"], ["loss backward"]),
]


@pytest.mark.distributed
def test_plan_peak_matches_the_peak_live_bytes_of_spawned_ranks(tiny_data, tmp_path):
    from megalite.testing.spawn import run_ranks
    from tests.memory_peaks import assert_plan_holds, peaks_rank

    runs = [run for run, _ in SPAWNED_PEAKS]
    for rank in run_ranks(peaks_rank, 2, args=(tiny_data, runs, tmp_path)):
        for (run, moments), measured in zip(SPAWNED_PEAKS, rank):
            assert_plan_holds(tiny_data, run, 2, measured, moments[measured["stage"]])
