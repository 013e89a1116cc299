"""Everything a maintainer with one GPU should measure, in one command that ends within its
budget (default 345 s: a GPU lent for 15 minutes, start-up included, leaves that much):

    megalite-bench gpu [--out DIR] [--budget-s 345] [--parts fp8,offload] [--data DIR]
    megalite-bench gpu --resume DIR     # a run cut short: only the parts DIR does not hold
    megalite-bench gpu --reduced        # tiny sizes on CPU: the test suite's form

(`python scripts/bench.py gpu` in a checkout is the same command.) Only the packages megalite
installs, no network. The parts run in this order — what has never run on a GPU first — each
in subprocesses with its own time limit (and never past the budget), so a cut run keeps the
most important and a part that fails or times out does not stop the rest:

  cuda-tests   tests/*/*/test_cuda*.py under pytest: passed / failed / skipped (from a
               checkout: the tests are not in the wheel) — the document mask's FlexAttention
               and varlen kernels, FP8's scaled products, the CP chunk kernels' CUDA branch
               (lower-right causal SDPA of one rank's chunks against full attention), the
               offloads' streams and pinned memory: every CUDA-only branch of megalite/
               (tests/unit/project/test_gpu_tests_hold.py holds the list)
  fp8          gpt2-xl compiled, launch path, in bf16 and with fp8.recipe=tensorwise and
               rowwise: tokens/s over bf16's, the loss against bf16's step by step, peak
               memory against the plan (`megalite_bench.gpu_fp8`)
  offload      `megalite-bench offload` on gpt2-xl, micro-batch 8 × 4: no offload,
               offload.optimizer=1, activation offload of every block and the planner's
               fewest blocks for a 44 GiB device, torchao's CPUOffloadOptimizer where it
               imports; one variant alive at a time, against the planner's prediction; warmed
               up past the first host step (it creates the AdamW moments), every timed step's
               seconds, and for optimizer offload a timeline of the copies, host steps and
               waits (`megalite.parallel.offload_timeline`)
  mfu          the benchmark path (`megalite_bench.gpu_worker`: bench.py train's model, engine
               and schedule, timed by phase) and the launch path (`pretrain.py` under torchrun,
               one rank, metrics.jsonl) for gpt2 and gpt2-xl, eager and compiled; each run's
               peak memory against its plan (`make_plan`) and the device table's prediction;
               the launch path once more at the benchmark's dropout (0) and once without the
               resilience defaults' checks, and per phase (`step_phases_s`) the launch path
               less the benchmark at equal dropout
  document-mask  `megalite-bench document-attention` at llama3-8b's heads, 8K tokens: the
               document mask's kernels (FlexAttention, the variable-length kernel, SDPA
               with a boolean mask) against causal attention at documents of 512, 2048 and
               8192 tokens, with their errors: the evidence for train.document_kernel's
               default
  calibrate    `megalite-plan --calibrate` at gpt2-xl's shapes, then the planner's prediction
               with that profile (and the table's) against every step the mfu part measured
  checkpoint   an async checkpoint's blocked time in the launch path (gpt2)
  rerun        resilience.rerun=on_nan with and without resilience.rerun_deterministic
               (gpt2, launch path): what deterministic algorithms cost

Launch-path runs are stopped once their timed steps are in metrics.jsonl (before the final
checkpoint every run writes: gpt2-xl's is 19 GB, not what is measured); the first steps
(compilation, warm-up) are not timed. A prepared corpus is needed (`--data`, default
data/stdlib; `megalite-prepare`, ~30 s, runs first if it is absent).

Rows are written as they come to DIR/report.json and DIR/report.md (the machine and versions
in the header), and each part's section to DIR/sections/<part>.json the moment the part ends
(atomically: renamed into place). A machine lost after 7 minutes leaves 7 minutes of sections;
`--resume DIR` (on the same or another machine) keeps them and runs only the parts of `--parts`
without one (a part the budget cut has none), and the report is assembled from the sections —
each names the GPU it ran on where that is not the header's. Figures are one run's medians on
one machine; compare them only with figures from the same kind of device.
"""
from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from megalite_bench.gpu_fp8 import RECIPES, fp8
from megalite_bench.gpu_mfu import measured_rows, mfu, mfu_specs
from megalite_bench.gpu_parts import (
    calibrate,
    checkpoint,
    cuda_tests,
    document_mask,
    offload,
    rerun,
)
from megalite_bench.gpu_session import GpuSession
from megalite_bench.gpu_sizes import PARTS, Sizes

# --- the command ---------------------------------------------------------------------------

RUNNERS = {"cuda-tests": cuda_tests, "fp8": fp8, "offload": offload, "mfu": mfu,
           "document-mask": document_mask, "calibrate": calibrate, "checkpoint": checkpoint,
           "rerun": rerun}  # PARTS' order: priority


def add_arguments(p) -> None:
    p.add_argument("--out", default=None,
                   help="the report's directory (default gpu-report/<UTC time>)")
    p.add_argument("--budget-s", type=float, default=345.0,
                   help="the whole command's seconds: each run's limit is cut to what is left "
                   "(default 345: a GPU lent for 15 minutes, start-up included)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, run in this order of priority: {','.join(PARTS)}")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="take up the report in DIR (an earlier run's --out, cut short): keep "
                   "the parts whose section is in DIR/sections and run only the missing ones "
                   "(of --parts)")
    p.add_argument("--data", default=None,
                   help="a prepared corpus (default data/stdlib, prepared if absent)")
    p.add_argument("--reduced", action="store_true",
                   help="tiny sizes on CPU (the test suite's form): the same parts, commands "
                   "and report, no GPU figures")
    p.add_argument("--mfu-runs", type=int, default=0,
                   help="only the first N runs of the mfu part (0: all)")


def run(args) -> dict:
    import torch

    # NVML's device count: no CUDA context (and its memory) in this process, whose children
    # need the GPU's memory
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if not args.reduced and not torch.cuda.is_available():
        raise SystemExit("megalite-bench gpu: no CUDA GPU here; --reduced runs the tiny CPU "
                         "form of the same parts")
    wanted = args.parts.split(",")
    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        raise SystemExit(f"megalite-bench gpu: --parts {','.join(unknown)}: not one of "
                         f"{','.join(PARTS)}")
    _resume_folder(args)
    if args.out is None:
        args.out = f"gpu-report/{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    bench = GpuSession(args)
    done = bench.report.resume() if args.resume else []
    bench.measured.update(measured_rows(bench.sizes, bench.report.parts.get("mfu")))
    chosen = [p for p in PARTS if p in wanted and p not in done]
    for name in chosen:
        bench.report.part(name).limit_s = _part_limit(bench.sizes, name)
    bench.report.write()
    kept = f" (kept from {bench.out}: {', '.join(done)})" if done else ""
    print(f"megalite-bench gpu: {', '.join(chosen) or 'nothing'} within {args.budget_s:.0f} s "
          f"-> {bench.out}/report.md{kept}", flush=True)
    for name in chosen:
        _run_part(bench, name)
    body = json.loads((bench.out / "report.json").read_text())
    print((bench.out / "report.md").read_text(), flush=True)
    return body


def _resume_folder(args) -> None:
    """`--resume DIR`: the report folder is DIR (refused when --out names another, or when
    DIR holds no report to take up)."""
    if not args.resume:
        return
    folder = Path(args.resume).resolve()
    if args.out is not None and Path(args.out).resolve() != folder:
        raise SystemExit(f"megalite-bench gpu: --resume {args.resume} with --out {args.out}: "
                         "a resumed run writes to the folder it resumes; give one of them")
    if not (folder / "report.json").is_file():
        raise SystemExit(f"megalite-bench gpu: --resume {args.resume}: no report.json there "
                         "(give the folder an earlier `megalite-bench gpu --out DIR` wrote)")
    args.out = str(folder)


def _run_part(bench: GpuSession, name: str) -> None:
    """One part, its fault its own row; its section written the moment it ends (a part the
    budget cut gets none: a resumed run runs it)."""
    part = bench.report.parts[name]
    if bench.remaining() < 5:
        part.status = "cut: the budget ran out"
        bench.report.write()
        return
    t0 = time.monotonic()
    print(f"megalite-bench gpu: {name} (limit {part.limit_s:.0f} s, "
          f"{bench.remaining():.0f} s left)", flush=True)
    try:
        RUNNERS[name](bench, part)
        if part.status == "not run":
            part.status = "ok"
    except Exception as e:  # one part's fault is that part's row, not the end
        part.status = f"failed: {e!r}"
    part.seconds = time.monotonic() - t0
    bench.report.write_section(part)
    print(f"megalite-bench gpu: {name}: {part.status} ({part.seconds:.0f} s)", flush=True)


def _part_limit(s: Sizes, name: str) -> float:
    """A part's limit: the sum of its runs' (each also cut by the budget)."""
    if name == "mfu":
        return sum(s.limits[f"{r.path}-compiled" if r.compile else r.path] for r in mfu_specs(s))
    if name == "rerun":
        return 2 * s.limits["rerun"]
    if name == "fp8":
        return len(RECIPES) * s.limits["launch-compiled" if s.compiles[0] else "launch"]
    return s.limits[name]
