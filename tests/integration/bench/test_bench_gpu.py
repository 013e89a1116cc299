"""`megalite-bench gpu --reduced`: the GPU command's tiny CPU form for real, so that it does
not rot between the rare GPU sessions — the benchmark path's worker and the launch path
(pretrain.py under torchrun) at equal dropout, their
rows, the per-phase gap and the report files. (The other parts' commands are checked without
running in tests/unit/bench/test_bench_gpu.py; the whole reduced form, every part, took 2 min 44 s
on the shared 2-core machine.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.distributed
def test_reduced_form_measures_both_paths_and_their_gap(tiny_data, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench.py"), "gpu", "--reduced", "--parts", "mfu",
         "--mfu-runs", "2", "--data", str(tiny_data), "--out", str(out), "--budget-s", "240"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    body = json.loads((out / "report.json").read_text())
    assert body["header"]["reduced"] is True and body["header"]["torch"]
    (mfu,) = body["parts"]
    assert mfu["name"] == "mfu" and mfu["status"] == "ok", mfu
    bench, launch, gap = mfu["rows"]
    assert bench["path"] == "bench" and bench["status"] == "ok" and bench["step_s"] > 0
    assert launch["status"].startswith("ok")  # stopped once its steps were in, or (tiny
    # steps outrun the 0.2 s poll) ended
    assert launch["dropout_on"] is False  # the metrics header's, as the bench's dropout
    for row in (bench, launch):
        assert set(row["phases_s"]) == {"data", "forward_backward", "grad_sync", "optimizer"}
        assert row["plan_gib"] > 0 and row["predicted_s"] > 0
    assert gap["run"].startswith("gap: launch tiny eager dropout 0 − bench tiny eager")
    assert gap["step_s"] == pytest.approx(launch["step_s"] - bench["step_s"])
    assert "## mfu — ok" in (out / "report.md").read_text()
