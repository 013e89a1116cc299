"""`megalite-selftest`'s plan, in this process: which layout classes fit a world, what is refused
by name before any work (megalite/cli/selftest.py, megalite/train/selftest.py), the link
check's rule (megalite/plan/link_check.py) and the text report."""
from __future__ import annotations

import pytest

from megalite.cli.selftest import parse_args, report_text
from megalite.cli.selftest_plan import BadInput, make_plan
from megalite.plan.devices import BY_NAME
from megalite.plan.link_check import judge
from megalite.train.selftest import crossing_groups, layout_checks, synthetic_data


def _names(world, per_node):
    return [c.name for c in layout_checks(world, per_node)[0]]


def test_every_layout_class_that_fits_the_world():
    assert _names(8, 8) == ["tp8", "tp8-sp", "pp2-1f1b", "pp2-interleaved", "pp2-zb-h1",
                            "cp2", "cp2-ring", "zero1", "zero3", "combined"]
    checks = {c.name: c for c in layout_checks(16, 8)[0]}
    assert dict(checks["combined"].sets)["tp"] == 8  # a node's TP group: PP across nodes
    assert crossing_groups(checks["combined"], 16, 8) == ["pp", "mp", "embedding"]
    assert crossing_groups(checks["tp8"], 16, 8) == ["dp"]
    assert dict(checks["cp2-ring"].sets) == {"cp": 2, "parallel.cp_comm": "ring"}
    assert crossing_groups(checks["cp2"], 16, 8) == ["dp", "dp_cp"]  # cp pairs inside a node
    fits, skipped = layout_checks(6, 6)  # tp 2 (6 = 2 x 3); tp 2 x pp 2 does not divide 6
    assert [c.name for c in fits] == ["tp2", "tp2-sp", "pp2-1f1b", "pp2-interleaved",
                                      "pp2-zb-h1", "cp2", "cp2-ring", "zero1", "zero3"]
    assert skipped == ["combined: needs tp >= 2 and pp 2 in the world (6)"]
    fits, skipped = layout_checks(3, 3)  # an odd world: ZeRO only
    assert [c.name for c in fits] == ["zero1", "zero3"] and len(skipped) == 4, skipped
    assert _names(4, 1) == ["pp2-1f1b", "pp2-interleaved", "pp2-zb-h1", "cp2", "cp2-ring",
                            "zero1", "zero3"]
    assert _names(1, 1) == ["recompute"]  # what fits one device


def _plan(tmp_path, argv, world=8, per_node=8, rank=0):
    data = synthetic_data(tmp_path / "data", vocab=256)
    return make_plan(parse_args(["--report-dir", str(tmp_path / "report"), *argv]), world,
                     per_node, rank, data)


@pytest.mark.slow
def test_the_plan_configures_each_layout_and_the_resume(tmp_path):
    plan = _plan(tmp_path, ["checkpoint.dir=" + str(tmp_path / "ckpt"),
                            "zero3:resilience.inject=rank:1/step:2/target:grad",
                            "zero3:resilience.allow_inject=true"])
    assert plan.precision == "fp32" and plan.tolerance.rel == 1e-5
    assert plan.resume == ("zero1", "combined") and plan.links == ["intra_node"]
    cfg = plan.configs["pp2-interleaved"]
    assert (cfg.pp, cfg.parallel.virtual_stages, cfg.train.micro_batch_size) == (2, 2, 1)
    assert plan.configs["tp8"].train.micro_batch_size == 8  # dp 1: one micro-batch of 8
    cp2 = plan.configs["cp2-ring"]  # dp 4: its share of the batch of 8
    assert (cp2.cp, cp2.parallel.cp_comm, cp2.train.micro_batch_size) == (2, "ring", 2)
    assert plan.serial.cp == 1
    assert plan.configs["zero3"].resilience.inject and not plan.configs["zero1"].resilience.inject
    assert (plan.serial.tp, plan.serial.pp, plan.serial.train.micro_batch_size) == (1, 1, 1)
    assert plan.checkpoint_root == tmp_path / "ckpt" / "megalite-selftest"


@pytest.mark.slow
@pytest.mark.parametrize("argv, world, refused", [
    (["--layouts", "tp3"], 8, "--layouts tp3: does not fit this world (8 ranks, 8 a node)"),
    (["--layouts", "nope"], 8, "--layouts nope: unknown"),
    (["--layouts", "zero1"], 1, "--layouts zero1: does not fit this world (1 ranks"),
    (["checkpoint.dir=/proc/megalite"], 8, "checkpoint.dir='/proc/megalite/megalite-selftest'"
                                           " is not writable"),
    (["--report-dir", "/proc/x"], 8, "--report-dir='/proc/x' is not writable"),
    (["pp2-1f1b:parallel.timeout_s=-1"], 8, "layout pp2-1f1b (pp=2 parallel.schedule=1f1b): "
                                            "parallel.timeout_s=-1"),
    (["tp9:tp=2"], 8, "tp9:...: no layout 'tp9' runs here"),
    (["--steps", "2", "--save-at", "2"], 8, "--steps 2 --save-at 2"),
    ([], 12, None),  # fits
])
def test_bad_input_is_refused_by_name_before_any_work(tmp_path, argv, world, refused):
    if refused is None:
        assert _plan(tmp_path, argv, world=world, per_node=4).checks
        return
    with pytest.raises(BadInput) as e:
        _plan(tmp_path, argv, world=world, per_node=world)
    assert refused in str(e.value), str(e.value)


def test_the_link_rule_on_cuda_and_what_cpu_compares_with():
    import torch

    entries = [{"op": "all_reduce", "group_size": 8, "bytes": b, "seconds": 1e-5 + b / 180e9 *
                2 * 7 / 8, "bus_gbps": 0.0} for b in (1 << 20, 16 << 20, 128 << 20)]
    h100 = BY_NAME["h100-80gb"]  # NVLink4 360 GB/s: 180 is the least that passes
    ok = judge("intra_node", entries, torch.device("cuda"), h100)
    assert ok["passed"] and ok["bus_gbps"] == pytest.approx(180, rel=1e-3), ok
    slow = [dict(e, seconds=e["seconds"] * 2) for e in entries]  # PCIe-like: half of that
    assert not judge("intra_node", slow, torch.device("cuda"), h100)["passed"]
    cpu = judge("intra_node", slow, torch.device("cpu"), BY_NAME["cpu"])
    assert cpu["passed"] and "not judged" in cpu["rule"] and cpu["table"]["name"] == "cpu"
    unknown = judge("inter_node", entries, torch.device("cuda"), None)
    assert unknown["passed"] and unknown["table"] is None


def test_the_text_report():
    report = {"passed": False, "world_size": 2, "nodes": 1, "ranks_per_node": 2,
              "device": "cpu", "precision": "fp32", "torch": "2.x", "skipped": ["tp: ..."],
              "tolerance_rule": "fp32: rel 1e-5", "seconds": 3.0,
              "checks": [{"name": "layout zero1", "kind": "layout", "passed": False,
                          "figure": 3e33, "tolerance": 1e-5, "layout": "zero=1",
                          "quantity": "grad norm at step 2", "crosses_nodes": []}]}
    text = report_text(report)
    assert "0 of 1 checks passed: FAIL" in text.splitlines()[0]
    assert "layout zero1" in text and "FAIL" in text.splitlines()[2] and "3.00e+33" in text
    assert "grad norm at step 2" in text and "skipped: tp: ..." in text


@pytest.mark.slow
def test_one_rank_runs_what_fits_one_device(tmp_path, monkeypatch):
    """Without a launcher (a world of one, as on one GPU): the serial run against
    recomputation, and the checkpoint resumed under the plain layout; no link to measure."""
    import json

    from megalite.cli.selftest import selftest

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert selftest(["--report-dir", str(tmp_path), "device=cpu"]) == 0
    report = json.loads((tmp_path / "selftest.json").read_text())
    assert [c["name"] for c in report["checks"]] == ["layout recompute",
                                                     "checkpoint recompute -> serial layout"]
    assert all(c["passed"] and c["figure"] <= 1e-5 for c in report["checks"]), report
    assert report["skipped"] == ["tp, pp, cp, zero: a world of one rank (what fits one device runs)"]
