"""A refused run under torchrun, as a user sees it: megalite's line and a short summary naming
the key (megalite-torchrun), torchrun's own summary carrying the ranks' message (plain
torchrun), and a hardware fault's exit status 75 reaching the scheduler."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BOGUS = "parallel.cp_comm='bogus': one of allgather, ring"


def launch(launcher, run_dir, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc_per_node=2",
           str(REPO / "scripts" / "pretrain.py"), f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True,
                          timeout=180)
    return proc.returncode, (proc.stdout + proc.stderr).splitlines()


@pytest.mark.distributed
def test_a_bad_key_under_megalite_torchrun_ends_in_a_few_lines(tmp_path):
    """megalite's line once, torchrun's agent's two log lines, the summary naming the key;
    the exit status is the ranks' own 2."""
    code, lines = launch("megalite.cli.torchrun", tmp_path / "run", "parallel.cp_comm=bogus")
    assert code == 2, lines
    assert len(lines) <= 6 and not any("Traceback" in line for line in lines), lines
    assert lines.count(f"megalite: bad configuration: {BOGUS}") == 1, lines
    assert any(line.startswith("  rank") and BOGUS in line for line in lines), lines


@pytest.mark.distributed
def test_plain_torchrun_shows_the_ranks_message_once_and_in_its_summary(tmp_path):
    code, lines = launch("torch.distributed.run", tmp_path / "run", "parallel.cp_comm=bogus")
    assert code == 1  # torchrun's own: any failure is 1 (megalite-torchrun keeps the 2)
    assert lines.count(f"megalite: bad configuration: {BOGUS}") == 1, lines  # one node
    summary = [line for line in lines if line.strip().startswith("traceback :")]
    assert summary and all(BOGUS in line for line in summary), lines  # from the error file


@pytest.mark.distributed
def test_a_hardware_fault_exits_75_through_megalite_torchrun(tmp_path):
    run = tmp_path / "run"
    (run / "resilience").mkdir(parents=True)
    (run / "resilience" / "fault.json").write_text(json.dumps(
        {"step": 7, "kind": "persistent", "rank": 1, "node": "gpu03", "gpu": 1}))
    code, lines = launch("megalite.cli.torchrun", run)
    assert code == 75, lines  # plain torchrun exits 1
    assert any(line.startswith("  rank") and "75" in line.split(":")[0] and
               "fault.json exists" in line for line in lines), lines  # every rank refuses
