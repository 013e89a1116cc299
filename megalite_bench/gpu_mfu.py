"""`megalite-bench gpu`'s mfu part: the benchmark path and the launch path for each preset, eager
and compiled, each run's peak against its plan and the table's predicted step, and per phase the
launch path less the benchmark at equal dropout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from megalite_bench.gpu_report import Part
from megalite_bench.gpu_runs import json_lines
from megalite_bench.gpu_session import GpuSession, planned
from megalite_bench.gpu_sizes import GIB, NO_DROPOUT, PHASES, RESILIENCE_OFF, Sizes


@dataclass(frozen=True)
class RunSpec:
    """One step-time measurement of the mfu part."""

    id: str
    path: str  # bench | launch
    preset: str
    compile: bool
    dropout: str  # "0" or "preset"
    resilience: bool = True  # the launch path's resilience defaults on


def mfu_specs(s: Sizes) -> List[RunSpec]:
    """The mfu part's runs, most important first: the big preset at the first compile mode
    on both paths at equal dropout (0), the launch path at the preset's dropout, then every
    other (preset, compile) pair on both paths, then the launch path without the resilience
    defaults' checks."""
    first = (s.big, s.compiles[0])
    pairs = [first] + [(p, c) for c in s.compiles for p in (s.small, s.big)
                       if (p, c) != first and p in s.presets]
    pairs = list(dict.fromkeys(pairs))
    out = []
    for p, c in pairs:
        mode = "compiled" if c else "eager"
        out.append(RunSpec(f"bench {p} {mode}", "bench", p, c, "0"))
        if (p, c) == first:
            out.append(RunSpec(f"launch {p} {mode} dropout 0", "launch", p, c, "0"))
        out.append(RunSpec(f"launch {p} {mode}", "launch", p, c, "preset"))
    p, c = first
    out.append(RunSpec(f"launch {p} {'compiled' if c else 'eager'} dropout 0 no resilience "
                       "checks", "launch", p, c, "0", resilience=False))
    return out


def train_overrides(s: Sizes, spec: RunSpec) -> List[str]:
    """A run's configuration: the launch path's overrides (less data, logging and the run
    directory), and what the planner is asked about for both paths."""
    mb = s.micro_batch[spec.preset]
    dropout = NO_DROPOUT if spec.dropout == "0" else s.preset_dropout
    return [*s.presets[spec.preset], *dropout, f"train.seq_len={s.seq_len}",
            f"train.micro_batch_size={mb}", f"train.global_batch_size={mb * s.micro_batches}",
            f"train.compile={str(spec.compile).lower()}", *s.device]


def worker_args(s: Sizes, spec: RunSpec, reduced: bool) -> List[str]:
    """`megalite_bench.gpu_worker`'s arguments for a bench-path run (always dropout 0, as
    `bench.py train` defaults to)."""
    return ["--model", *s.presets[spec.preset], "--micro-batch", str(s.micro_batch[spec.preset]),
            "--micro-batches", str(s.micro_batches), "--seq-len", str(s.seq_len), "--compile",
            str(int(spec.compile)), "--dropout", "0", "--steps", str(s.bench_steps),
            "--warmup", str(s.bench_warmup),
            *(["--device", "cpu", "--peak-tflops", "1"] if reduced else [])]


def mfu(bench: GpuSession, part: Part) -> None:
    s = bench.sizes
    data = bench.ensure_data(part)
    specs = mfu_specs(s)[:bench.args.mfu_runs or None]
    for spec in specs:
        overrides = train_overrides(bench.sizes, spec)
        kind = "compiled" if spec.compile else ""
        limit = s.limits[f"{spec.path}-{kind}".rstrip("-")]
        row = {"run": spec.id, "path": spec.path, "preset": spec.preset,
               "compile": spec.compile, "dropout": spec.dropout}
        if spec.path == "bench":
            cmd = [bench.python, "-m", "megalite_bench.gpu_worker",
                   *worker_args(s, spec, bench.args.reduced)]
            ran = bench.run(part, spec.id, cmd, limit)
            got = (json_lines(ran.output) or [{}])[-1]
            memory = got.get("memory", {})
            got["peak_bytes"] = memory.get("peak_allocated_bytes",
                                           memory.get("peak_rss_bytes"))
        elif data is None:
            row["status"] = "skipped: no corpus"
            part.rows.append(row)
            continue
        else:
            launch = overrides + ([] if spec.resilience else RESILIENCE_OFF)
            ran, got = bench.launch(part, spec.id, launch, limit)
            got.pop("records", None)
        row["status"] = got.get("error") or ran.status()
        fill(bench, row, got, overrides)
        if "step_s" in got and ran.ok:
            bench.measured[spec.id] = {**row, "overrides": overrides}
        else:
            part.notes.append(f"{spec.id}: {row['status']}\n{ran.tail()}")
        part.rows.append(row)
        bench.report.write()
    ok = sum(1 for r in part.rows if r.get("status", "").startswith("ok"))
    part.rows += gaps(bench, specs)
    part.status = "ok" if ok == len(specs) else f"partial: {ok} of {len(specs)} runs ok"
    part.notes.append("phases: the device-timeline seconds of each phase per step "
                      "(megalite.train.timers); the launch path's step_s is wall time per "
                      "step (metrics, checks and Python between phases included), the "
                      "bench path's the sum of its phases")


def measured_rows(s: Sizes, part: Optional[Part]) -> Dict[str, dict]:
    """What a finished mfu part measured, by run id (as `mfu` keeps it for calibrate): a
    resumed run's calibrate predicts the steps of the mfu part it kept."""
    rows = {r.get("run"): r for r in (part.rows if part else [])}
    out = {}
    for spec in mfu_specs(s):
        row = rows.get(spec.id)
        if row and row.get("step_s") and str(row.get("status", "")).startswith("ok"):
            out[spec.id] = {**row, "overrides": train_overrides(s, spec)}
    return out


def fill(bench: GpuSession, row: dict, got: dict, overrides: List[str]) -> None:
    """Measured figures, the plan's peak and the device table's prediction into `row`."""
    plan_bytes, predicted = planned(overrides, bench.table, bench.args.reduced)
    plan_bytes = got.get("plan_bytes") or plan_bytes
    peak = got.get("peak_bytes")
    row.update(step_s=got.get("step_s"), mfu=got.get("mfu"),
               tokens_per_s=got.get("tokens_per_s"),
               peak_gib=peak / GIB if peak else None,
               plan_gib=plan_bytes / GIB if plan_bytes else None,
               peak_over_plan=peak / plan_bytes if peak and plan_bytes else None,
               predicted_s=predicted,
               predicted_over_measured=predicted / got["step_s"]
               if predicted and got.get("step_s") else None,
               dropout_on=got.get("dropout_on"), phases_s=got.get("phases_s"))


def gaps(bench: GpuSession, specs: List[RunSpec]) -> List[dict]:
    """Per phase, one run less another: the launch path less the bench path at equal
    dropout, the preset's dropout less none, the resilience checks' share."""
    m = bench.measured
    first = specs[0] if specs else None
    if first is None:
        return []
    mode = "compiled" if first.compile else "eager"
    p = first.preset
    pairs = [(f"launch {p} {mode} dropout 0", f"bench {p} {mode}",
              "the launch path less the benchmark path, both dropout 0"),
             (f"launch {p} {mode}", f"launch {p} {mode} dropout 0",
              "the preset's dropout less none, both launch path"),
             (f"launch {p} {mode} dropout 0", f"launch {p} {mode} dropout 0 no resilience "
              "checks", "the resilience defaults' checks, launch path")]
    rows = []
    for a, b, what in pairs:
        if a in m and b in m and m[a].get("phases_s") and m[b].get("phases_s"):
            diff = {ph: m[a]["phases_s"][ph] - m[b]["phases_s"][ph] for ph in PHASES}
            step = m[a]["step_s"] - m[b]["step_s"]
            rows.append({"run": f"gap: {a} − {b}", "path": what, "step_s": step,
                         "phases_s": diff,
                         "outside_phases_s": step - sum(diff.values()),
                         "status": "ok (difference)"})
    return rows
