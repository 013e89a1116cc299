"""Simulated scale (megalite/cli/verify_rank.py): rank R of an N-rank layout built for real on the
fake process-group backend with tensors on meta, set next to the plan; every case inits and
destroys its own fake process group (`fake_world`), so they run in this one process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.cli.test_verify_rank import GPT_175B

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.distributed
def test_script_prints_the_report_as_json():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "verify_rank.py"),
                          "--verify-rank", "0", "--world-size", "4096", "--json", *GPT_175B],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    result = json.loads(out.stdout)
    assert result["layout"] == {"tp": 8, "cp": 1, "pp": 16, "dp": 32, "zero": 1, "sp": True,
                                "virtual_stages": 1, "world_size": 4096, "ep": 1,
                                "rank_order": "tp-cp-pp-dp"}
    assert result["params"]["built"] == result["params"]["planned"]
    assert set(result["bytes"]) == {"P", "G", "O"}
    assert all(abs(v["ratio"] - 1) < 0.01 for v in result["bytes"].values())
    assert set(result["seconds"]) == {"imports", "topology", "model", "engine", "total"}
