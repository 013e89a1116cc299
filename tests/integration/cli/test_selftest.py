"""`megalite-selftest` (megalite/cli/selftest.py) on 8 gloo ranks: every layout class that fits
against the serial run computed on rank 0, a checkpoint resumed under another layout, the
link check, the EP exchange, the report; a fault drill in one layout's gradient
(`resilience.inject`, inside the rank, through the documented drill API) fails that layout by
name; bad input is refused by name before any work."""
from __future__ import annotations

import json
import time

import pytest

from megalite.cli.selftest import main as selftest_main
from megalite.testing.spawn import run_ranks

DRILL = ["zero1:resilience.inject=rank:1/step:2/target:grad",
         "zero1:resilience.allow_inject=true"]


def _selftest(rank, world, argv_runs):
    """Each argv of `argv_runs` through the command's main, in the same 8 ranks: its exit
    status and seconds."""
    out = []
    for argv in argv_runs:
        t0 = time.perf_counter()
        try:
            selftest_main(argv)
        except SystemExit as e:
            out.append({"code": e.code, "seconds": time.perf_counter() - t0})
    return out


@pytest.mark.distributed
def test_the_selftest_passes_on_8_ranks_and_names_a_drilled_layout(tmp_path, capfd):
    """One world of 8 ranks runs the command three times: every check passes (exit 0: CP's
    classes too); a
    drill flips a bit of rank 1's gradient at step 2 in the zero1 layout only: zero1 fails,
    pp2-1f1b passes (exit 1); a layout that does not fit is refused (exit 2)."""
    report, drilled = tmp_path / "report", tmp_path / "drilled"
    ckpt = tmp_path / "ckpt"
    runs = [["--report-dir", str(report), f"checkpoint.dir={ckpt}"],
            ["--report-dir", str(drilled), "--layouts", "zero1", "pp2-1f1b", "--no-links",
             "--no-resume", *DRILL],
            ["--report-dir", str(tmp_path / "refused"), "--layouts", "tp3"]]
    t0 = time.perf_counter()
    res = run_ranks(_selftest, 8, args=(runs,), timeout_s=300)
    took = time.perf_counter() - t0
    assert all([r["code"] for r in ranks] == [0, 1, 2] for ranks in res), res
    assert "megalite: selftest: --layouts tp3: does not fit this world (8 ranks" in \
        capfd.readouterr().err
    assert not (tmp_path / "refused").exists()  # refused before any work

    rep = json.loads((report / "selftest.json").read_text())
    assert rep["passed"] and rep["world_size"] == 8 and rep["precision"] == "fp32", rep
    names = [c["name"] for c in rep["checks"]]
    assert names == ["layout tp8", "layout tp8-sp", "layout pp2-1f1b", "layout pp2-interleaved",
                     "layout pp2-zb-h1", "layout cp2", "layout cp2-ring", "layout zero1",
                     "layout zero3", "layout combined",
                     "checkpoint zero1 -> combined", "link intra_node", "ep8 exchange"], names
    for c in rep["checks"]:
        assert c["passed"], c
        if c["kind"] not in ("link", "exchange"):
            assert 0 <= c["figure"] <= c["tolerance"] == 1e-5, c
    link, exchange = rep["checks"][-2:]
    assert link["figure"] > 0 and link["group_size"] == 8 and link["table"]["name"] == "cpu"
    assert "not judged" in link["tolerance_rule"]
    assert exchange["figure"] == 0 and exchange["groups"] == [list(range(8))], exchange
    text = (report / "selftest.txt").read_text()
    assert text.startswith("megalite self-test: 8 ranks (1 node(s) x 8), cpu, fp32") and \
        "13 of 13 checks passed: PASS" in text, text
    assert not (ckpt / "megalite-selftest").exists()  # passed: its checkpoints removed

    bad = json.loads((drilled / "selftest.json").read_text())
    verdicts = {c["name"]: c["passed"] for c in bad["checks"]}
    assert verdicts == {"layout zero1": False, "layout pp2-1f1b": True}, bad["checks"]
    zero1 = next(c for c in bad["checks"] if c["name"] == "layout zero1")
    assert zero1["figure"] > 1e-3 and zero1["tolerance"] == 1e-5, zero1
    assert "layout zero1" in (drilled / "selftest.txt").read_text().split("FAIL")[1]
    print(f"8 ranks, three runs: {took:.1f} s; {[round(r['seconds'], 1) for r in res[0]]}")
