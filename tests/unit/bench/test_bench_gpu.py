"""`megalite-bench gpu` (megalite_bench/gpu.py) without a GPU and without starting torch: the
commands its full form would run are valid (parsed by the parsers that will read them), what
it parses from pytest, the benchmark worker and metrics.jsonl, the time limits (a command is
killed at its limit, or once it has what it was run for), and that a failing part or an
exhausted budget does not stop the report. tests/integration/bench/test_bench_gpu.py runs the
reduced form for real."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pytest

from megalite_bench import gpu, gpu_runs, gpu_session
from megalite_bench.gpu_mfu import mfu_specs, train_overrides, worker_args
from megalite_bench.gpu_report import render_markdown
from megalite_bench.gpu_runs import (
    group_members,
    json_lines,
    parse_pytest,
    read_metrics,
    run_command,
    summarize_launch,
)
from megalite_bench.gpu_sizes import FULL, PARTS, REDUCED, RESILIENCE_OFF


def test_the_full_forms_runs_in_priority_order():
    specs = mfu_specs(FULL)
    assert [s.id for s in specs[:3]] == ["bench gpt2-xl compiled",
                                        "launch gpt2-xl compiled dropout 0",
                                        "launch gpt2-xl compiled"]
    assert {(s.path, s.preset, s.compile) for s in specs} == {
        (path, p, c) for path in ("bench", "launch") for p in ("gpt2", "gpt2-xl")
        for c in (True, False)}
    assert specs[-1].resilience is False and all(s.resilience for s in specs[:-1])
    assert len(specs) == 10
    assert [s.id for s in mfu_specs(REDUCED)] == [
        "bench tiny eager", "launch tiny eager dropout 0", "launch tiny eager",
        "launch tiny eager dropout 0 no resilience checks"]


@pytest.mark.parametrize("sizes", [FULL, REDUCED], ids=["full", "reduced"])
def test_every_command_of_the_form_parses(sizes):
    """The launch path's overrides validate for one rank, the worker's and the offload
    bench's arguments parse, the calibration's overrides load: a renamed option or key fails
    here, not on a lent GPU."""
    from megalite.config.schema import check_sections, load_config
    from megalite.train.preflight import validated_config
    from megalite_bench.cli import BENCHMARKS
    from megalite_bench.gpu_worker import parser as worker_parser

    device = "cpu" if sizes is REDUCED else "cuda"
    for spec in mfu_specs(sizes):
        overrides = train_overrides(sizes, spec)
        cfg, _ = validated_config(overrides + RESILIENCE_OFF + [
            "log.wandb=false", "log.progress=false", "train.eval_every=0", "log.every=1",
            "checkpoint.every=2", "checkpoint.async_save=true", "resilience.rerun=on_nan",
            "resilience.rerun_deterministic=false"], 1, 1, device)
        assert cfg.train.compile == spec.compile
        assert (cfg.model.resid_pdrop > 0) == (spec.dropout == "preset")  # presets: 0.1
        args = worker_parser().parse_args(worker_args(sizes, spec, sizes is REDUCED))
        assert args.compile == int(spec.compile) and args.dropout == 0
    offload = argparse.ArgumentParser()
    BENCHMARKS["offload"][0].add_arguments(offload)
    offload.parse_args(sizes.offload + ["--out", "x.json"])
    documents = argparse.ArgumentParser()
    BENCHMARKS["document-attention"][0].add_arguments(documents)
    documents.parse_args(sizes.document_mask + ["--out", "x.json"])
    check_sections(load_config(sizes.calibrate))


def test_parsing_pytest_worker_and_metrics(tmp_path):
    out = "....F\nFAILED tests/unit/parallel/test_cuda.py::test_x - AssertionError: 1\n" \
          "===== 1 failed, 16 passed, 3 skipped in 35.21s =====\n"
    got = parse_pytest(out)
    assert (got["passed"], got["failed"], got["skipped"], got["seconds"]) == (16, 1, 3, 35.21)
    assert got["failures"] == ["tests/unit/parallel/test_cuda.py::test_x"]
    assert parse_pytest("20 skipped in 0.97s")["skipped"] == 20
    assert parse_pytest("ERROR collecting\n1 error in 2.0s")["errors"] == 1
    assert json_lines('noise\n{"step_s": 1.5}\n{bad\n') == [{"step_s": 1.5}]
    path = tmp_path / "metrics.jsonl"
    header = {"run": {"dropout_on": True, "plan": {"stages": [{"bytes": {"total": 4e9}}]}}}
    records = [{"step": i, "step_time_s": t, "mfu": 0.5, "tokens_per_s": 100.0,
                "memory": {"peak_allocated_bytes": 5e9 + i},
                "step_phases_s": {"data": 0.0, "forward_backward": t - 0.1,
                                  "grad_sync": 0.0, "optimizer": 0.1}}
               for i, t in enumerate([9.0, 1.0, 1.2, 1.1], 1)]
    path.write_text("\n".join(json.dumps(x) for x in [header, *records]) + '\n{"step": 5, "st')
    head, recs = read_metrics(path)
    assert head["dropout_on"] and len(recs) == 4  # the partly written line left out
    got = summarize_launch(head, recs, skip=1, steps=3)
    assert got["step_s"] == 1.1 and got["plan_bytes"] == 4e9 and got["peak_bytes"] == 5e9 + 4
    assert got["phases_s"]["forward_backward"] == pytest.approx(1.0) and got["dropout_on"]
    assert "no timed step records" in summarize_launch(head, recs, skip=4, steps=3)["error"]
    assert read_metrics(tmp_path / "none.jsonl") == (None, [])


def test_a_command_is_killed_at_its_limit_or_once_it_has_its_steps(tmp_path):
    t0 = time.monotonic()
    slow = run_command([sys.executable, "-c", "import time; print('up', flush=True); "
                        "time.sleep(60)"], 1.0, log=tmp_path / "slow.log")
    assert slow.timed_out and not slow.ok and slow.rc is None and "up" in slow.output
    assert time.monotonic() - t0 < 20 and "timed out" in slow.status()
    assert (tmp_path / "slow.log").read_text().startswith("$ ")
    marker = tmp_path / "done"
    seen = []
    stopped = run_command([sys.executable, "-c", f"import pathlib, time; print('a', flush=True)"
                           f"; pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"], 30.0,
                          on_line=seen.append, stop_when=marker.exists)
    assert stopped.ok and stopped.stopped and seen == ["a"]
    failed = run_command([sys.executable, "-c", "raise SystemExit(3)"], 30.0)
    assert failed.rc == 3 and not failed.ok and failed.status() == "failed (exit status 3)"


def test_a_stopped_run_returns_only_once_its_workers_are_gone(tmp_path, monkeypatch):
    """A rank that outlives its launcher (as torchrun's workers do, releasing GPU memory as they
    exit) is waited for: the next run must not start beside it. The kill is made to reach the
    launcher alone, so the worker lingers 2 s after it, as a dying CUDA process does."""
    monkeypatch.setattr(gpu_runs.os, "killpg", lambda pgid, sig: os.kill(pgid, sig))
    marker = tmp_path / "up"
    launcher = ("import os, pathlib, subprocess, sys, time; "
                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(2)'], "
                "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                f"print(os.getpid(), flush=True); pathlib.Path({str(marker)!r}).touch(); "
                "time.sleep(60)")
    pids = []
    ran = run_command([sys.executable, "-c", launcher], 30.0, on_line=pids.append,
                      stop_when=marker.exists)
    assert ran.stopped and pids
    assert group_members(int(pids[0])) == []


def test_a_failing_part_and_the_budget_do_not_stop_the_report(tmp_path, monkeypatch):
    """A part that raises is reported failed and the next runs; once the budget is spent the
    rest are reported cut; report.json and report.md hold every part."""
    def broken(self, part):
        raise RuntimeError("broken on purpose")

    class Clock:  # the command's clock: each slow part takes 4 s of it
        now = 0.0

        def monotonic(self):
            return self.now

    clock = Clock()

    def slow(self, part):
        part.rows.append({"run": "x", "step_s": 1.0, "phases_s": {"data": 0.0}})
        clock.now += 4.0

    monkeypatch.setattr(gpu, "time", clock)
    monkeypatch.setattr(gpu_session, "time", clock)
    monkeypatch.setitem(gpu.RUNNERS, "cuda-tests", broken)
    monkeypatch.setitem(gpu.RUNNERS, "mfu", slow)
    monkeypatch.setitem(gpu.RUNNERS, "offload", slow)
    monkeypatch.setattr(gpu_session, "machine_header", lambda *a: {"started": "now", "gpu": None})
    args = argparse.Namespace(out=str(tmp_path / "r"), budget_s=10.0, parts="cuda-tests,mfu,"
                              "offload,calibrate", data=None, reduced=True, mfu_runs=0,
                              resume=None)
    body = gpu.run(args)
    status = {p["name"]: p["status"] for p in body["parts"]}
    assert status["cuda-tests"].startswith("failed: RuntimeError('broken on purpose')")
    assert status["mfu"] == "ok" and status["offload"] == "ok"
    assert status["calibrate"] == "cut: the budget ran out"
    text = (tmp_path / "r" / "report.md").read_text()
    assert "## mfu — ok" in text and "| run | step_s | phases_s |" in text
    assert json.loads((tmp_path / "r" / "report.json").read_text())["parts"][1]["rows"]
    sections = sorted(p.stem for p in (tmp_path / "r" / "sections").glob("*.json"))
    assert sections == ["cuda-tests", "mfu", "offload"]  # the cut part has none: resume runs it
    assert render_markdown({"header": {}, "parts": []}).startswith("# megalite-bench gpu")


def test_the_parts_run_what_never_ran_on_a_gpu_first():
    """The CUDA tests, then FP8's speed, then the offload, then MFU (calibrate after mfu:
    it predicts mfu's steps); every part has its runner."""
    assert PARTS[:4] == ("cuda-tests", "fp8", "offload", "mfu")
    assert PARTS.index("calibrate") > PARTS.index("mfu") and set(gpu.RUNNERS) == set(PARTS)


def _fake_parts(monkeypatch, clock, lost_at=None):
    """Every runner a fake adding one row and 10 s of the command's clock; at the part named
    `lost_at` the machine is lost (the process ends mid-part: SystemExit from inside it)."""
    ran = []

    def runner(name):
        def part_runner(bench, part):
            ran.append(name)
            if name == lost_at:
                raise KeyboardInterrupt("the machine is gone")
            part.rows.append({"run": name, "step_s": 1.0, "status": "ok"})
            clock.now += 10.0
        return part_runner
    for name in PARTS:
        monkeypatch.setitem(gpu.RUNNERS, name, runner(name))
    return ran


class _Clock:  # the command's clock
    now = 0.0

    def monotonic(self):
        return self.now


def test_a_lost_machine_keeps_every_finished_part_and_resume_runs_only_the_rest(
        tmp_path, monkeypatch):
    """Each part's section is in DIR/sections the moment it ends; a machine lost in the third
    part leaves the first two; --resume DIR (another GPU) runs only the missing parts of
    --parts, and the report holds every part in order, each naming the GPU it ran on."""
    clock = _Clock()
    monkeypatch.setattr(gpu, "time", clock)
    monkeypatch.setattr(gpu_session, "time", clock)
    gpus = iter(["H200", "H100"])
    monkeypatch.setattr(gpu_session, "machine_header",
                        lambda *a: {"started": f"t{clock.now:.0f}", "gpu": next(gpus)})
    out = tmp_path / "r"
    args = argparse.Namespace(out=str(out), budget_s=1000.0, parts=",".join(PARTS[:5]),
                              data=None, reduced=True, mfu_runs=0, resume=None)
    ran = _fake_parts(monkeypatch, clock, lost_at=PARTS[2])
    with pytest.raises(KeyboardInterrupt):
        gpu.run(args)
    assert ran == list(PARTS[:3])
    assert sorted(p.stem for p in (out / "sections").glob("*.json")) == sorted(PARTS[:2])
    kept = json.loads((out / "sections" / f"{PARTS[0]}.json").read_text())
    assert kept["rows"] == [{"run": PARTS[0], "step_s": 1.0, "status": "ok"}]
    assert kept["device"] == "H200" and kept["status"] == "ok" and kept["finished"]

    ran = _fake_parts(monkeypatch, clock)
    again = argparse.Namespace(out=None, budget_s=1000.0, parts=",".join(PARTS[:4]), data=None,
                               reduced=True, mfu_runs=0, resume=str(out))
    body = gpu.run(again)
    assert ran == list(PARTS[2:4])  # the missing parts of --parts, nothing twice
    assert [p["name"] for p in body["parts"]] == list(PARTS[:4])
    assert [p["device"] for p in body["parts"]] == ["H200", "H200", "H100", "H100"]
    assert body["header"]["gpu"] == "H200" and body["header"]["resumed"][0]["gpu"] == "H100"
    text = (out / "report.md").read_text()
    assert f"## {PARTS[2]} — ok (10 s of a" in text and "on H100)" in text
    assert f"## {PARTS[0]} — ok (10 s of a" in text
    assert sorted(p.stem for p in (out / "sections").glob("*.json")) == sorted(PARTS[:4])


def test_resume_refuses_a_folder_without_a_report_or_beside_another_out(tmp_path):
    args = argparse.Namespace(out=None, budget_s=10.0, parts="mfu", data=None, reduced=True,
                              mfu_runs=0, resume=str(tmp_path / "none"))
    with pytest.raises(SystemExit, match="--resume .*none: no report.json there"):
        gpu.run(args)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text('{"header": {}, "parts": []}')
    args.resume, args.out = str(tmp_path / "r"), str(tmp_path / "other")
    with pytest.raises(SystemExit, match="writes to the folder it resumes"):
        gpu.run(args)


def test_a_resumed_calibrate_predicts_the_kept_mfu_steps():
    """A kept mfu section's ok rows are what calibrate predicts (their overrides rebuilt);
    a failed run and a gap row are not."""
    from megalite_bench.gpu_mfu import measured_rows
    from megalite_bench.gpu_report import Part

    first, second = mfu_specs(REDUCED)[:2]
    part = Part("mfu", rows=[{"run": first.id, "step_s": 0.5, "status": "ok"},
                             {"run": second.id, "step_s": None, "status": "failed (exit 1)"},
                             {"run": "gap: x", "step_s": 0.1, "status": "ok (difference)"}])
    got = measured_rows(REDUCED, part)
    assert list(got) == [first.id] and got[first.id]["overrides"] == train_overrides(
        REDUCED, first)
    assert measured_rows(REDUCED, None) == {}


def test_the_test_plugins_load_without_datasets(monkeypatch):
    """The GPU machine has torch and transformers but not `datasets`: the plugin conftest
    registers (tests/data_fixtures.py) must still load there, or no CUDA test collects."""
    import importlib.util
    from pathlib import Path

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises
    path = Path(__file__).parents[2] / "data_fixtures.py"
    spec = importlib.util.spec_from_file_location("data_fixtures_without_datasets", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_the_checkout_and_its_commit_are_found_from_any_directory(tmp_path, monkeypatch):
    """Run from elsewhere, the command still finds the checkout beside its package (the CUDA
    tests are there, not in the wheel) and names its commit in the report's header."""
    from pathlib import Path

    from megalite_bench.gpu_report import machine_header

    repo = Path(gpu_session.__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    assert gpu_session.checkout() == repo
    if (repo / ".git").exists():
        assert f"({repo}: " in machine_header(True, 1.0, sys.executable)["megalite"]
