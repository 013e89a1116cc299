"""The commands on one GPU, as a user runs them (needs one CUDA GPU; skipped without):
pretrain.py under torchrun (one rank: NCCL's group on the device) with optimizer offload, an
async checkpoint, the rerun on NaN with deterministic kernels, straggler reports, the hang
watch and the profiler on, then resumed from its checkpoint; generate.py from that checkpoint
on its default device; the self-test (`--no-links`: a link needs two GPUs) and a
single-process calibration. What they run is what the CPU suite cannot: the runtime's
device, RNG and metrics on CUDA, the loader's pinned copies, the services' CUDA branches
(tests/unit/project/cuda_branches.py lists them). `megalite-bench gpu`'s cuda-tests part runs
it. Written against CUDA semantics; not yet run on a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[3]
ON_GPU = [o for o in TINY if not o.startswith("device=")] + ["device=cuda"]
FEATURES = ["offload.optimizer=0.5", "checkpoint.every=2", "checkpoint.async_save=true",
            "resilience.rerun=on_nan", "resilience.rerun_deterministic=true",
            "resilience.straggler_report_every=2", "resilience.check_every=2",
            "log.profile_steps=[2,3]", "log.every=1", "log.wandb=false", "train.eval_every=2"]


def _run(cmd, cwd, timeout=240):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _records(run_dir: Path):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["run"] for x in lines if "run" in x], [x for x in lines if "step" in x]


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """Four steps on the GPU, then two more resumed from the step-4 checkpoint."""
    run = tmp_path_factory.mktemp("cuda") / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(REPO / "scripts" / "pretrain.py"), f"hydra.run.dir={run}",
           f"data.dir={tiny_data}", *ON_GPU, *FEATURES]
    _run(cmd + ["train.max_steps=4"], run.parent)
    _run(cmd + ["train.max_steps=6", "checkpoint.resume=auto"], run.parent)
    return run


def test_pretrain_on_one_gpu_and_its_resume(trained):
    headers, records = _records(trained)
    assert len(headers) == 2 and [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert headers[0]["peak_source"] and headers[0]["peak_tflops_per_device"] > 0
    for r in records:
        assert r["memory"]["peak_allocated_bytes"] > 0 and r["tokens_per_s"] > 0
        assert torch.isfinite(torch.tensor(r["loss"]))
    assert (trained / "checkpoints" / "step_00000004" / "meta.json").is_file()
    assert (trained / "checkpoints" / "step_00000006" / "meta.json").is_file()
    assert any((trained / "profile").iterdir())  # the profiler's trace of steps 2-3


def test_generate_runs_on_the_gpu_by_default(trained):
    from megalite.cli.generate import parse_args

    ckpt = trained / "checkpoints"
    assert parse_args([str(ckpt), "--prompt", "def"]).device == "cuda"
    proc = _run([sys.executable, str(REPO / "scripts" / "generate.py"), str(ckpt), "--prompt",
                 "def", "--max-new-tokens", "8", "--temperature", "0"], trained.parent)
    assert proc.stdout.strip()


def test_the_selftest_on_one_gpu(tmp_path):
    report = tmp_path / "report"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
          str(REPO / "scripts" / "selftest.py"), "--report-dir", str(report), "--steps", "3",
          "--no-links", f"checkpoint.dir={tmp_path / 'ckpt'}"], tmp_path, timeout=300)
    got = json.loads((report / "selftest.json").read_text())
    assert got["passed"] and got["device"] == torch.cuda.get_device_name(0)


def test_a_single_process_calibration_on_one_gpu(tmp_path):
    out = tmp_path / "profile.json"
    _run([sys.executable, str(REPO / "scripts" / "plan.py"), "--calibrate", "--output",
          str(out), *ON_GPU], tmp_path, timeout=300)
    profile = json.loads(out.read_text())
    assert profile["hbm_gbps"] > 0 and profile["device"] == torch.cuda.get_device_name(0)
