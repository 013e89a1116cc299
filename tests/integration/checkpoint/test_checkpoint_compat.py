"""On-disk compatibility: a checkpoint written by an older megalite (FORMAT_VERSION 3, commit in
tests/fixtures/ckpt_v3/README.md) still resumes, under another layout, onto the same loss curve.

The fixture (tests/fixtures/ckpt_v3, made by its make_fixture.sh) holds its own prepared data
directory, the step-4 checkpoint of a tiny single-rank fp32 run without dropout, and
expected.json: that run's overrides and its losses at steps 5..8. Here the checkpoint is resumed
on two ranks (tp=2, or dp=2 with ZeRO-1) through the command line only — scripts/pretrain.py
under torchrun, metrics.jsonl read back — since megalite's internal module paths may change.

The checkpoint's meta.json records the absolute data directory it was written with (and its
CRC32 covers it, so it is left as written): resuming with this checkout's data.dir prints a
"data=... differs" warning, which is expected; the data are the same bytes.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from megalite.checkpoint.format import meta_crc32

REPO = Path(__file__).resolve().parents[3]
FIXTURE = REPO / "tests" / "fixtures" / "ckpt_v3"
TOLERANCE = 1e-5  # absolute, on the loss (about 5.4 here: 2e-6 relative)


def resume(tmp_path: Path, layout: list, order: Optional[str]) -> subprocess.CompletedProcess:
    """Resume the fixture's checkpoint on 2 ranks; `order`: the sample order its sampler state
    names (None: as written, without the key, as before orders were named)."""
    expected = json.loads((FIXTURE / "expected.json").read_text())
    ckpt = tmp_path / expected["checkpoint"]  # a copy: the fixture is never written to
    shutil.copytree(FIXTURE / expected["checkpoint"], ckpt)
    if order is not None:  # as main wrote them once the order was named (before issue 19)
        meta = json.loads((ckpt / "meta.json").read_text())
        meta["sampler"]["order"] = order
        meta["meta_crc32"] = meta_crc32(meta)
        (ckpt / "meta.json").write_text(json.dumps(meta))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "scripts" / "pretrain.py"), f"hydra.run.dir={tmp_path / 'run'}",
           f"data.dir={FIXTURE / 'data'}", *expected["overrides"], *layout,
           f"checkpoint.dir={tmp_path / 'checkpoints'}", f"checkpoint.resume={ckpt}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    # torchrun ends stderr with its own summary: keep enough to show the rank's traceback
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-12000:]
    return proc


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout,expected_layout,order", [
    (["tp=2"], {"tp": 2, "dp": 1, "zero": 0}, None),
    (["zero=1"], {"tp": 1, "dp": 2, "zero": 1}, "permutation-v1"),
], ids=["tp2_no_order_name", "dp2_zero1_permutation_v1"])
def test_format_v3_checkpoint_resumes_under_another_layout(tmp_path, layout, expected_layout,
                                                           order):
    """Both kinds of data position written before the bijection order continue in the old
    permutation: without an order name, and naming "permutation-v1"."""
    expected = json.loads((FIXTURE / "expected.json").read_text())
    losses = {int(step): loss for step, loss in expected["losses"].items()}
    proc = resume(tmp_path, layout, order)
    lines = [json.loads(line)
             for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    header, records = lines[0]["run"], lines[1:]
    for key, value in expected_layout.items():
        assert header["layout"][key] == value, header["layout"]
    assert header["layout"]["world_size"] == 2
    # resumed at step 4 (a run from scratch would log steps 1..8)
    assert [r["step"] for r in records] == sorted(losses), proc.stdout[-3000:]
    for r in records:
        assert r["loss"] == pytest.approx(losses[r["step"]], rel=0, abs=TOLERANCE), \
            (r["step"], r["loss"], losses[r["step"]])
    # the run wrote its own checkpoint (into tmp_path), at the end
    assert (tmp_path / "checkpoints" / "step_00000008" / "meta.json").is_file()
