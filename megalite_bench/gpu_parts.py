"""`megalite-bench gpu`'s parts besides mfu: the CUDA tests' counts, the document mask's kernels
side by side, the offload sweep against the
planner, a calibration against the measured steps, an async checkpoint's blocked time and
resilience.rerun_deterministic's cost."""
from __future__ import annotations

import json
import re
from typing import List, Optional, Tuple

from megalite_bench.gpu_mfu import RunSpec, train_overrides
from megalite_bench.gpu_report import Part
from megalite_bench.gpu_runs import parse_pytest
from megalite_bench.gpu_session import GpuSession, planned
from megalite_bench.gpu_sizes import NO_DROPOUT
from megalite_bench.offload_draw import draw


def variant_of(name: str) -> Tuple[Optional[float], bool, Optional[int]]:
    """(fraction, activations, their first K blocks or None: all) of an offload bench
    variant's name (fraction None: not megalite's)."""
    if not name.startswith("optimizer="):
        return None, False, None
    words = name.split()
    layers = re.search(r"activations\(first (\d+)\)", name)
    return float(words[0].split("=")[1]), "activations" in name, \
        int(layers.group(1)) if layers else None


def cuda_tests(bench: GpuSession, part: Part) -> None:
    tests = sorted((bench.repo / "tests").glob("*/*/test_cuda*.py")) if bench.repo else []
    if not tests:
        part.status = "skipped: no tests/*/*/test_cuda*.py (run from a checkout)"
        return
    ran = bench.run(part, "cuda-tests", [bench.python, "-m", "pytest", "-q", "-rfE",
                                        "-p", "no:cacheprovider",
                                        *[str(t.relative_to(bench.repo)) for t in tests]],
                   bench.sizes.limits["cuda-tests"], cwd=bench.repo)
    counts = parse_pytest(ran.output)
    part.rows.append({"files": len(tests), **counts, "status": ran.status()})
    part.status = f"{counts['failed'] + counts.get('errors', 0)} failed or in error" \
        if ran.rc == 1 else ran.status()
    if ran.rc not in (0, 1):
        part.notes.append(ran.tail())


def document_mask(bench: GpuSession, part: Part) -> None:
    """`megalite-bench document-attention`: the document mask's kernels against causal
    attention; which of flex and varlen is faster at each document length."""
    out = bench.out / "document_attention.json"
    ran = bench.run(part, "document-attention", [bench.python, "-m", "megalite_bench.cli",
                                                "document-attention", *bench.sizes.document_mask,
                                                "--out", str(out)],
                   bench.sizes.limits["document-mask"])
    rows = json.loads(out.read_text()) if out.is_file() else []
    part.rows += rows
    for length in sorted({r["document_tokens"] for r in rows}):
        timed = [r for r in rows if r["document_tokens"] == length and r["ms"] is not None]
        if timed:
            part.notes.append(f"documents of {length} tokens: fastest "
                              f"{min(timed, key=lambda r: r['ms'])['kernel']}")
    part.status = ran.status()
    if not ran.ok:
        part.notes.append(ran.tail())


def offload(bench: GpuSession, part: Part) -> None:
    s = bench.sizes
    out = bench.out / "offload.json"
    rows: List[dict] = []

    def on_line(line: str) -> None:
        if line.startswith("{") and '"variant"' in line:
            rows.append(json.loads(line))
    ran = bench.run(part, "offload", [bench.python, "-m", "megalite_bench.cli", "offload",
                                     *s.offload, "--out", str(out)],
                   s.limits["offload"], on_line=on_line)
    final = [r for r in json.loads(out.read_text()) if r.get("bench") == "step"] \
        if out.is_file() else rows  # the ratios come with the whole sweep
    preset = s.offload[s.offload.index("--preset") + 1]
    seq = s.offload[s.offload.index("--seq-len") + 1] if "--seq-len" in s.offload \
        else str(s.seq_len)
    for r in final:
        row = {k: r.get(k) for k in ("variant", "micro_batch", "m", "step_s", "ratio",
                                     "offload_wait_s", "timeline_s", "peak_memory_gib", "mfu",
                                     "baseline_spread", "error")}
        row["step_times_s"] = r.get("times_s")  # every timed step, after the warm-up
        if r.get("timeline"):
            part.notes.append(f"timeline of {r['variant']} (micro-batch {r['micro_batch']} x "
                              f"{r['m']}; {out.name}'s `timeline` holds every span):\n\n"
                              + "\n".join(f"      {line}" for line in draw(r["timeline"])))
        fraction, activations, layers = variant_of(r.get("variant", ""))
        if fraction is not None and r.get("step_s"):
            mb, m = r["micro_batch"], r["m"]
            _, predicted = planned([f"model={preset}", *NO_DROPOUT,
                                     f"train.seq_len={seq}", f"train.micro_batch_size={mb}",
                                     f"train.global_batch_size={mb * m}",
                                     f"offload.optimizer={fraction:g}",
                                     f"offload.activations={str(activations).lower()}",
                                     *([f"offload.activations_layers={layers}"]
                                       if layers else []),
                                     *s.device], bench.table, bench.args.reduced)
            row.update(predicted_s=predicted, predicted_over_measured=predicted / r["step_s"]
                       if predicted else None)
        part.rows.append(row)
    part.status = ran.status()
    if not ran.ok:
        part.notes.append(ran.tail())


def calibrate(bench: GpuSession, part: Part) -> None:
    s = bench.sizes
    profile = bench.out / "profile.json"
    launcher = [bench.python, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "-m"] if bench.args.reduced else [bench.python, "-m"]
    ran = bench.run(part, "calibrate", [*launcher, "megalite.cli.plan", "--calibrate",
                                       "--output", str(profile), *s.calibrate],
                   s.limits["calibrate"])
    part.status = ran.status()
    if not profile.is_file():
        part.notes.append(ran.tail())
        return
    from megalite.plan.devices import load_profile_file

    calibrated = load_profile_file(profile)
    part.notes.append(f"profile {profile}: matmul TFLOP/s {dict(calibrated.matmul_tflops)}"
                      f"; HBM {calibrated.hbm_gbps} GB/s; copies h2d {calibrated.h2d_gbps} "
                      f"d2h {calibrated.d2h_gbps} GB/s; host AdamW "
                      f"{calibrated.host_adam_params_per_s} parameters/s on "
                      f"{calibrated.host_threads} threads")
    for run_id, measured in bench.measured.items():
        _, with_profile = planned(measured["overrides"], calibrated, bench.args.reduced)
        row = {"run": run_id, "measured_s": measured["step_s"],
               "predicted_profile_s": with_profile,
               "profile_error": with_profile / measured["step_s"] - 1
               if with_profile else None,
               "predicted_table_s": measured.get("predicted_s"),
               "table_error": measured["predicted_s"] / measured["step_s"] - 1
               if measured.get("predicted_s") else None}
        part.rows.append(row)


def checkpoint(bench: GpuSession, part: Part) -> None:
    s = bench.sizes
    if bench.ensure_data(part) is None:
        part.status = "skipped: no corpus"
        return
    spec = RunSpec("checkpoint", "launch", s.small, False, "preset")
    steps = s.launch_skip + s.launch_steps + 1
    overrides = train_overrides(bench.sizes, spec) + [
        "checkpoint.every=2", "checkpoint.async_save=true", f"train.max_steps={steps}"]
    ran, got = bench.launch(part, f"checkpoint {s.small} async", overrides,
                            s.limits["checkpoint"], timed=False)
    for r in got.get("records", []):
        if r.get("checkpoint_blocked_s"):
            part.rows.append({"step": r["step"], "blocked_s": r["checkpoint_blocked_s"],
                              "step_time_s": r["step_time_s"]})
    part.status = ran.status()
    part.notes.append("blocked_s: the seconds the loop waited for the save at that step "
                      "(the snapshot into the pinned staging buffer; the write goes on in "
                      "the background); step_time_s excludes it")
    if not ran.ok:
        part.notes.append(ran.tail())


def rerun(bench: GpuSession, part: Part) -> None:
    s = bench.sizes
    if bench.ensure_data(part) is None:
        part.status = "skipped: no corpus"
        return
    spec = RunSpec("rerun", "launch", s.small, False, "preset")
    base = train_overrides(bench.sizes, spec)
    times = {}
    for deterministic in ("true", "false"):
        name = f"rerun on_nan deterministic {deterministic}"
        ran, got = bench.launch(part, name, base + [
            "resilience.rerun=on_nan", f"resilience.rerun_deterministic={deterministic}"],
            s.limits["rerun"])
        times[deterministic] = got.get("step_s")
        part.rows.append({"run": name, "status": got.get("error") or ran.status(),
                          "step_s": got.get("step_s"), "phases_s": got.get("phases_s")})
    off = bench.measured.get(f"launch {s.small} eager", {}).get("step_s")
    if times.get("true") and times.get("false"):
        part.rows.append({"run": "deterministic / not", "step_s": times["true"]
                          / times["false"], "status": "ok (ratio)"})
    if off and times.get("true"):
        part.rows.append({"run": f"rerun deterministic / launch {s.small} eager (rerun "
                          "off, mfu part)", "step_s": times["true"] / off,
                          "status": "ok (ratio)"})
    part.status = "ok" if all(times.values()) else "partial"
