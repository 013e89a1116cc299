"""Everything a maintainer with one GPU should measure, in one command that ends within its
budget (default 345 s: a GPU lent for 15 minutes, start-up included, leaves that much):

    megalite-bench gpu [--out DIR] [--budget-s 345] [--parts mfu,offload] [--data DIR]
    megalite-bench gpu --reduced        # tiny sizes on CPU: the test suite's form

(`python scripts/bench.py gpu` in a checkout is the same command.) Only the packages megalite
installs, no network. The parts run in this order of priority, each in subprocesses with its
own time limit (and never past the budget), so a cut run keeps the most important and a part
that fails or times out does not stop the rest:

  cuda-tests   tests/unit/test_cuda*.py under pytest: passed / failed / skipped (from a
               checkout: the tests are not in the wheel)
  mfu          the benchmark path (`megalite.bench.gpu_worker`: bench.py train's model, engine
               and schedule, timed by phase) and the launch path (`pretrain.py` under torchrun,
               one rank, metrics.jsonl) for gpt2 and gpt2-xl, eager and compiled; each run's
               peak memory against its plan (`make_plan`) and the device table's prediction;
               the launch path once more at the benchmark's dropout (0) and once without the
               resilience defaults' checks, and per phase (`step_phases_s`) the launch path
               less the benchmark at equal dropout
  offload      `megalite-bench offload` on gpt2-xl: optimizer 0 / 0.5 / 1 × activations off /
               on, one variant alive at a time, against the planner's prediction
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
in the header): an interrupted run leaves what it measured. Figures are one run's medians on
one machine; compare them only with figures from the same kind of device.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

PARTS = ("cuda-tests", "mfu", "offload", "calibrate", "checkpoint", "rerun")
PHASES = ("data", "forward_backward", "grad_sync", "optimizer")
RESILIENCE_OFF = ["resilience.check_every=0", "resilience.straggler_report_every=0",
                  "resilience.hang_dump=false", "resilience.hang_signal=null"]
NO_DROPOUT = ["model.resid_pdrop=0", "model.embd_pdrop=0", "model.attn_pdrop=0"]
GIB = 2**30


@dataclass(frozen=True)
class Sizes:
    """What the parts run: the full form on a GPU, the reduced one (tiny, CPU) in tests."""

    presets: Dict[str, List[str]]  # name -> model overrides
    micro_batch: Dict[str, int]
    micro_batches: int
    seq_len: int
    compiles: Tuple[bool, ...]
    bench_steps: int
    bench_warmup: int
    launch_skip: int  # records not timed (compilation, warm-up)
    launch_steps: int  # records timed
    preset_dropout: List[str]  # the overrides of a run at "the preset's dropout"
    big: str  # the preset of the offload sweep, the calibration and the equal-dropout run
    small: str  # the preset of the checkpoint and rerun parts
    offload: List[str]  # megalite-bench offload's options
    calibrate: List[str]
    limits: Dict[str, float]  # seconds per run kind
    device: List[str]  # the launch path's device override


FULL = Sizes(
    presets={"gpt2": ["model=gpt2"], "gpt2-xl": ["model=gpt2-xl"]},
    micro_batch={"gpt2": 16, "gpt2-xl": 16}, micro_batches=4, seq_len=1024,
    compiles=(True, False), bench_steps=3, bench_warmup=2, launch_skip=2, launch_steps=3,
    preset_dropout=[], big="gpt2-xl", small="gpt2",
    offload=["--preset", "gpt2-xl", "--micro-batch", "8", "--micro-batches", "2", "--steps",
             "2", "--warmup", "1", "--baseline-every", "3", "--skip-adam"],
    calibrate=["model=gpt2-xl", "train.seq_len=1024", "train.micro_batch_size=4"],
    limits={"cuda-tests": 90, "bench": 90, "bench-compiled": 150, "launch": 90,
            "launch-compiled": 150, "offload": 170, "calibrate": 90, "checkpoint": 80,
            "rerun": 70, "prepare": 90},
    device=[])

TINY = ["model=tiny", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
        "model.n_positions=64", "model.vocab_size=1024"]
REDUCED = Sizes(
    presets={"tiny": TINY}, micro_batch={"tiny": 2}, micro_batches=2, seq_len=32,
    compiles=(False,), bench_steps=2, bench_warmup=1, launch_skip=1, launch_steps=2,
    preset_dropout=["model.resid_pdrop=0.1", "model.embd_pdrop=0.1", "model.attn_pdrop=0.1"],
    big="tiny", small="tiny",
    offload=["--preset", "tiny", "--seq-len", "32", "--micro-batch", "2", "--micro-batches",
             "1", "--steps", "1", "--warmup", "1", "--adam-params", "80000",
             "--variants", "1"],
    calibrate=[*TINY, "train.seq_len=32", "train.micro_batch_size=2"],
    limits={"cuda-tests": 120, "bench": 60, "bench-compiled": 60, "launch": 90,
            "launch-compiled": 90, "offload": 90, "calibrate": 90, "checkpoint": 90,
            "rerun": 90, "prepare": 120},
    device=["device=cpu", "log.peak_tflops=1"])  # MFU against a nominal 1 TFLOP/s on CPU


# --- running a command ---------------------------------------------------------------------

@dataclass
class Ran:
    rc: Optional[int]  # None: killed (time limit or stopped)
    seconds: float
    output: str  # stdout and stderr, interleaved
    timed_out: bool = False
    stopped: bool = False  # stopped by `stop_when` (it had what it was run for)
    cut: bool = False  # not started: the budget ran out

    @property
    def ok(self) -> bool:
        return self.rc == 0 or self.stopped

    def status(self) -> str:
        if self.cut:
            return "cut: the budget ran out"
        if self.stopped:
            return "ok (stopped once its steps were in)"
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        return "ok" if self.rc == 0 else f"failed (exit status {self.rc})"

    def tail(self, lines: int = 12) -> str:
        return "\n".join(self.output.strip().splitlines()[-lines:])


def run_command(cmd: Sequence[str], limit_s: float, cwd: Optional[Path] = None,
                env: Optional[dict] = None, log: Optional[Path] = None,
                on_line: Optional[Callable[[str], None]] = None,
                stop_when: Optional[Callable[[], bool]] = None) -> Ran:
    """Run `cmd` in a session of its own for at most `limit_s` seconds; its whole process
    group is killed at the limit, or once `stop_when()` says it has what it was run for.
    Each output line goes to `on_line` as it comes (and to `log`)."""
    t0 = time.monotonic()
    lines: List[str] = []
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                try:
                    on_line(line.rstrip("\n"))
                except Exception:  # a parser's fault must not stop the reading
                    pass
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = stopped = False
    while proc.poll() is None:
        if time.monotonic() - t0 > limit_s:
            timed_out = True
        elif stop_when is not None and stop_when():
            stopped = True
        if timed_out or stopped:
            _kill_group(proc)
            break
        time.sleep(0.2)
    proc.wait()
    reader.join(timeout=5)
    output = "".join(lines)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {' '.join(map(str, cmd))}\n{output}")
    return Ran(None if timed_out or stopped else proc.returncode, time.monotonic() - t0,
               output, timed_out, stopped)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --- parsing what the commands print -------------------------------------------------------

def parse_pytest(output: str) -> dict:
    """Counts of pytest's last summary line ("3 passed, 2 skipped in 4.10s") and the failed
    tests' ids (-rfE)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    seconds = None
    for line in reversed(output.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)",
                           line)
        timing = re.search(r" in ([0-9.]+)s", line)
        if found and timing:
            for n, word in found:
                counts["errors" if word.startswith("error") else word] = int(n)
            seconds = float(timing.group(1))
            break
    failures = [line.split(" ", 1)[1].split(" - ")[0] for line in output.splitlines()
                if line.startswith(("FAILED ", "ERROR "))]
    return {**counts, "seconds": seconds, "failures": failures}


def json_lines(output: str) -> List[dict]:
    """The JSON objects a command printed one a line."""
    rows = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def read_metrics(path: Path) -> Tuple[Optional[dict], List[dict]]:
    """(header, step records) of a metrics.jsonl (its last run segment); (None, []) when
    absent. A partly written last line is left out."""
    if not path.is_file():
        return None, []
    header, records = None, []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "run" in entry:
            header, records = entry["run"], []
        elif "step" in entry:
            records.append(entry)
    return header, records


def summarize_launch(header: Optional[dict], records: List[dict], skip: int,
                     steps: int) -> dict:
    """The timed records' medians: step time, MFU, each phase; peak memory; the plan's peak
    and whether dropout was on (the header's)."""
    timed = records[skip:skip + steps]
    if not timed:
        return {"error": f"no timed step records ({len(records)} written, {skip} not timed)"}
    phases = {p: statistics.median(r.get("step_phases_s", {}).get(p, 0.0) for r in timed)
              for p in PHASES}
    memory = [r.get("memory", {}) for r in timed]
    peak = max((m.get("peak_allocated_bytes", m.get("peak_rss_bytes", 0)) for m in memory),
               default=0)
    plan = None
    if header and header.get("plan", {}).get("stages"):
        plan = max(s["bytes"]["total"] for s in header["plan"]["stages"])
    return {"step_s": statistics.median(r["step_time_s"] for r in timed),
            "steps_s": [r["step_time_s"] for r in timed],
            "mfu": statistics.median(r["mfu"] for r in timed) if all(
                r.get("mfu") is not None for r in timed) else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "phases_s": phases, "peak_bytes": peak, "plan_bytes": plan,
            "dropout_on": header.get("dropout_on") if header else None,
            "checkpoint_blocked_s": [r.get("checkpoint_blocked_s", 0.0) for r in records]}


# --- the report ----------------------------------------------------------------------------

@dataclass
class Part:
    name: str
    limit_s: float = 0.0
    status: str = "not run"
    seconds: float = 0.0
    rows: List[dict] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    commands: List[str] = field(default_factory=list)


class Report:
    """report.json and report.md in `out`, rewritten after every row."""

    def __init__(self, out: Path, header: dict):
        self.out, self.header = out, header
        self.parts: Dict[str, Part] = {}
        out.mkdir(parents=True, exist_ok=True)

    def part(self, name: str) -> Part:
        return self.parts.setdefault(name, Part(name))

    def write(self) -> None:
        body = {"header": self.header, "parts": [vars(p) for p in self.parts.values()]}
        _atomic(self.out / "report.json", json.dumps(body, indent=1, default=str) + "\n")
        _atomic(self.out / "report.md", render_markdown(body))


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return " ".join(f"{k} {_cell(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return str(value).replace("|", "/").replace("\n", " ")


def render_markdown(body: dict) -> str:
    h = body["header"]
    lines = [f"# megalite-bench gpu — {h.get('started', '')}", ""]
    lines += [f"- {k}: {_cell(v)}" for k, v in h.items() if k != "started"]
    for p in body["parts"]:
        lines += ["", f"## {p['name']} — {p['status']} ({p['seconds']:.0f} s of a {p['limit_s']:.0f} s "
                  "limit)", ""]
        rows = p["rows"]
        if rows:
            keys: List[str] = []
            for r in rows:
                keys += [k for k in r if k not in keys and k not in ("steps_s", "overrides",
                                                                        "checkpoint_blocked_s")]
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
        lines += [""] + [f"- {n}" for n in p["notes"]] if p["notes"] else []
        if p["commands"]:
            lines += ["", "Commands:", ""] + [f"    {c}" for c in p["commands"]]
    return "\n".join(lines) + "\n"


def machine_header(reduced: bool, budget_s: float, python: str) -> dict:
    """The machine and versions, without creating a CUDA context in this process (which
    would hold GPU memory the runs need): nvidia-smi, else a short subprocess."""
    import torch

    header = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "reduced": reduced, "budget_s": budget_s, "host": platform.node(),
              "host_cores": os.cpu_count(), "python": platform.python_version(),
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "megalite": _megalite_version()}
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=15).stdout.strip().splitlines()
            if out:
                name, memory, driver = [x.strip() for x in out[0].split(",")][:3]
                header.update(gpu=name, gpu_memory=memory, driver=driver, gpus=len(out))
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    if "gpu" not in header:
        header["gpu"] = None if reduced else _gpu_name(python)
    return header


def _gpu_name(python: str) -> Optional[str]:
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.cuda.get_device_name() "
                              "if torch.cuda.is_available() else '')"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
        return out or None
    except (OSError, subprocess.SubprocessError):
        return None


def _megalite_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("megalite")
    except PackageNotFoundError:
        v = "not installed"
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists() and shutil.which("git"):
        try:
            commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()
            v += f" ({root}: {commit})"
        except (OSError, subprocess.SubprocessError):
            pass
    return v


# --- the parts -----------------------------------------------------------------------------

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
    """`megalite.bench.gpu_worker`'s arguments for a bench-path run (always dropout 0, as
    `bench.py train` defaults to)."""
    return ["--model", *s.presets[spec.preset], "--micro-batch", str(s.micro_batch[spec.preset]),
            "--micro-batches", str(s.micro_batches), "--seq-len", str(s.seq_len), "--compile",
            str(int(spec.compile)), "--dropout", "0", "--steps", str(s.bench_steps),
            "--warmup", str(s.bench_warmup),
            *(["--device", "cpu", "--peak-tflops", "1"] if reduced else [])]


class GpuBench:
    def __init__(self, args):
        self.args = args
        self.sizes = REDUCED if args.reduced else FULL
        self.python = sys.executable
        self.deadline = time.monotonic() + args.budget_s
        self.out = Path(args.out).resolve()
        self.report = Report(self.out, machine_header(args.reduced, args.budget_s,
                                                      self.python))
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
        self.env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as measured
        self.report.header["PYTORCH_CUDA_ALLOC_CONF"] = self.env["PYTORCH_CUDA_ALLOC_CONF"]
        self.repo = _checkout()
        self.data: Optional[Path] = Path(args.data).resolve() if args.data else None
        self.measured: Dict[str, dict] = {}  # mfu rows by id (what calibrate predicts)
        self.table = _table_profile(self.report.header.get("gpu"), args.reduced)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, part: Part, name: str, cmd: List[str], limit: float, **kw) -> Ran:
        """`cmd` under min(limit, the budget left); logged to DIR/logs/<name>.log."""
        limit = min(limit, self.remaining())
        part.commands.append(" ".join(map(str, cmd)))
        if limit < 5:
            return Ran(None, 0.0, "not started: the budget ran out", cut=True)
        return run_command(cmd, limit, cwd=kw.pop("cwd", self.out), env=self.env,
                           log=self.out / "logs" / f"{_slug(name)}.log", **kw)

    # --- cuda-tests ------------------------------------------------------------------------

    def cuda_tests(self, part: Part) -> None:
        tests = sorted((self.repo / "tests" / "unit").glob("test_cuda*.py")) if self.repo \
            else []
        if not tests:
            part.status = "skipped: no tests/unit/test_cuda*.py (run from a checkout)"
            return
        ran = self.run(part, "cuda-tests", [self.python, "-m", "pytest", "-q", "-rfE",
                                            "-p", "no:cacheprovider",
                                            *[str(t.relative_to(self.repo)) for t in tests]],
                       self.sizes.limits["cuda-tests"], cwd=self.repo)
        counts = parse_pytest(ran.output)
        part.rows.append({"files": len(tests), **counts, "status": ran.status()})
        part.status = f"{counts['failed'] + counts.get('errors', 0)} failed or in error" \
            if ran.rc == 1 else ran.status()
        if ran.rc not in (0, 1):
            part.notes.append(ran.tail())

    # --- mfu -------------------------------------------------------------------------------

    def _ensure_data(self, part: Part) -> Optional[Path]:
        if self.data is None:
            self.data = (self.out / "data" / "stdlib-reduced") if self.args.reduced else \
                (Path.cwd() / "data" / "stdlib").resolve()
        if (self.data / "meta.json").is_file():
            return self.data
        extra = ["data.max_documents=150", "data.tokenizer_vocab_size=1024",
                 "data.num_proc=1"] if self.args.reduced else []
        ran = self.run(part, "prepare", [self.python, "-m", "megalite.cli.prepare",
                                         f"data.dir={self.data}", *extra],
                       self.sizes.limits["prepare"])
        if not (self.data / "meta.json").is_file():
            part.notes.append(f"no corpus at {self.data}: {ran.status()}\n{ran.tail()}")
            return None
        part.notes.append(f"prepared {self.data} in {ran.seconds:.0f} s")
        return self.data

    def _train_overrides(self, spec: RunSpec) -> List[str]:
        return train_overrides(self.sizes, spec)

    def _launch(self, part: Part, name: str, overrides: List[str], limit: float,
                timed: bool = True) -> Tuple[Ran, dict]:
        """pretrain.py under torchrun, one rank; stopped once its timed records are in."""
        s = self.sizes
        run_dir = self.out / "runs" / _slug(name)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        steps = s.launch_skip + s.launch_steps
        metrics = run_dir / "metrics.jsonl"
        cmd = [self.python, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=1", "-m", "megalite.cli.pretrain", f"hydra.run.dir={run_dir}",
               f"data.dir={self.data}", *overrides, "log.wandb=false", "log.progress=false",
               "train.eval_every=0", "log.every=1"]
        if timed:  # never reached: the run is stopped once its records are in, before the
            cmd.append(f"train.max_steps={steps + 20}")  # final checkpoint of its last step
        ran = self.run(part, name, cmd, limit,
                       stop_when=(lambda: len(read_metrics(metrics)[1]) >= steps)
                       if timed else None)
        header, records = read_metrics(metrics)
        summary = summarize_launch(header, records, s.launch_skip, s.launch_steps)
        return ran, {**summary, "records": records}

    def mfu(self, part: Part) -> None:
        s = self.sizes
        data = self._ensure_data(part)
        specs = mfu_specs(s)[:self.args.mfu_runs or None]
        for spec in specs:
            overrides = self._train_overrides(spec)
            kind = "compiled" if spec.compile else ""
            limit = s.limits[f"{spec.path}-{kind}".rstrip("-")]
            row = {"run": spec.id, "path": spec.path, "preset": spec.preset,
                   "compile": spec.compile, "dropout": spec.dropout}
            if spec.path == "bench":
                cmd = [self.python, "-m", "megalite.bench.gpu_worker",
                       *worker_args(s, spec, self.args.reduced)]
                ran = self.run(part, spec.id, cmd, limit)
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
                ran, got = self._launch(part, spec.id, launch, limit)
                got.pop("records", None)
            row["status"] = got.get("error") or ran.status()
            self._fill(row, got, overrides)
            if "step_s" in got and ran.ok:
                self.measured[spec.id] = {**row, "overrides": overrides}
            else:
                part.notes.append(f"{spec.id}: {row['status']}\n{ran.tail()}")
            part.rows.append(row)
            self.report.write()
        ok = sum(1 for r in part.rows if r.get("status", "").startswith("ok"))
        part.rows += self._gaps(specs)
        part.status = "ok" if ok == len(specs) else f"partial: {ok} of {len(specs)} runs ok"
        part.notes.append("phases: the device-timeline seconds of each phase per step "
                          "(megalite.train.timers); the launch path's step_s is wall time per "
                          "step (metrics, checks and Python between phases included), the "
                          "bench path's the sum of its phases")

    def _fill(self, row: dict, got: dict, overrides: List[str]) -> None:
        """Measured figures, the plan's peak and the device table's prediction into `row`."""
        plan_bytes, predicted = _planned(overrides, self.table, self.args.reduced)
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

    def _gaps(self, specs: List[RunSpec]) -> List[dict]:
        """Per phase, one run less another: the launch path less the bench path at equal
        dropout, the preset's dropout less none, the resilience checks' share."""
        m = self.measured
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

    # --- offload ---------------------------------------------------------------------------

    def offload(self, part: Part) -> None:
        s = self.sizes
        out = self.out / "offload.json"
        rows: List[dict] = []

        def on_line(line: str) -> None:
            if line.startswith("{") and '"variant"' in line:
                rows.append(json.loads(line))
        ran = self.run(part, "offload", [self.python, "-m", "megalite.cli.bench", "offload",
                                         *s.offload, "--out", str(out)],
                       s.limits["offload"], on_line=on_line)
        final = [r for r in json.loads(out.read_text()) if r.get("bench") == "step"] \
            if out.is_file() else rows  # the ratios come with the whole sweep
        preset = s.offload[s.offload.index("--preset") + 1]
        seq = s.offload[s.offload.index("--seq-len") + 1] if "--seq-len" in s.offload \
            else str(s.seq_len)
        for r in final:
            row = {k: r.get(k) for k in ("variant", "micro_batch", "m", "step_s", "ratio",
                                         "offload_wait_s", "peak_memory_gib", "mfu",
                                         "baseline_spread", "error")}
            fraction, activations = _variant(r.get("variant", ""))
            if fraction is not None and r.get("step_s"):
                mb, m = r["micro_batch"], r["m"]
                _, predicted = _planned([f"model={preset}", *NO_DROPOUT,
                                         f"train.seq_len={seq}", f"train.micro_batch_size={mb}",
                                         f"train.global_batch_size={mb * m}",
                                         f"offload.optimizer={fraction:g}",
                                         f"offload.activations={str(activations).lower()}",
                                         *s.device], self.table, self.args.reduced)
                row.update(predicted_s=predicted, predicted_over_measured=predicted / r["step_s"]
                           if predicted else None)
            part.rows.append(row)
        part.status = ran.status()
        if not ran.ok:
            part.notes.append(ran.tail())

    # --- calibrate -------------------------------------------------------------------------

    def calibrate(self, part: Part) -> None:
        s = self.sizes
        profile = self.out / "profile.json"
        launcher = [self.python, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2", "-m"] if self.args.reduced else [self.python, "-m"]
        ran = self.run(part, "calibrate", [*launcher, "megalite.cli.plan", "--calibrate",
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
        for run_id, measured in self.measured.items():
            _, with_profile = _planned(measured["overrides"], calibrated, self.args.reduced)
            row = {"run": run_id, "measured_s": measured["step_s"],
                   "predicted_profile_s": with_profile,
                   "profile_error": with_profile / measured["step_s"] - 1
                   if with_profile else None,
                   "predicted_table_s": measured.get("predicted_s"),
                   "table_error": measured["predicted_s"] / measured["step_s"] - 1
                   if measured.get("predicted_s") else None}
            part.rows.append(row)

    # --- checkpoint ------------------------------------------------------------------------

    def checkpoint(self, part: Part) -> None:
        s = self.sizes
        if self._ensure_data(part) is None:
            part.status = "skipped: no corpus"
            return
        spec = RunSpec("checkpoint", "launch", s.small, False, "preset")
        steps = s.launch_skip + s.launch_steps + 1
        overrides = self._train_overrides(spec) + [
            "checkpoint.every=2", "checkpoint.async_save=true", f"train.max_steps={steps}"]
        ran, got = self._launch(part, f"checkpoint {s.small} async", overrides,
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

    # --- rerun -----------------------------------------------------------------------------

    def rerun(self, part: Part) -> None:
        s = self.sizes
        if self._ensure_data(part) is None:
            part.status = "skipped: no corpus"
            return
        spec = RunSpec("rerun", "launch", s.small, False, "preset")
        base = self._train_overrides(spec)
        times = {}
        for deterministic in ("true", "false"):
            name = f"rerun on_nan deterministic {deterministic}"
            ran, got = self._launch(part, name, base + [
                "resilience.rerun=on_nan", f"resilience.rerun_deterministic={deterministic}"],
                s.limits["rerun"])
            times[deterministic] = got.get("step_s")
            part.rows.append({"run": name, "status": got.get("error") or ran.status(),
                              "step_s": got.get("step_s"), "phases_s": got.get("phases_s")})
        off = self.measured.get(f"launch {s.small} eager", {}).get("step_s")
        if times.get("true") and times.get("false"):
            part.rows.append({"run": "deterministic / not", "step_s": times["true"]
                              / times["false"], "status": "ok (ratio)"})
        if off and times.get("true"):
            part.rows.append({"run": f"rerun deterministic / launch {s.small} eager (rerun "
                              "off, mfu part)", "step_s": times["true"] / off,
                              "status": "ok (ratio)"})
        part.status = "ok" if all(times.values()) else "partial"


def _variant(name: str) -> Tuple[Optional[float], bool]:
    """(fraction, activations) of an offload bench variant's name (None: not megalite's)."""
    if not name.startswith("optimizer="):
        return None, False
    words = name.split()
    return float(words[0].split("=")[1]), "activations" in words


def _planned(overrides: List[str], profile, reduced: bool) -> Tuple[Optional[float],
                                                                    Optional[float]]:
    """(the plan's peak bytes, the predicted step on `profile`) of a one-rank run."""
    try:
        from megalite.config.layout import Layout
        from megalite.plan.memory import make_plan
        from megalite.plan.time_model import predict
        from megalite.train.preflight import validated_config

        device = "cpu" if reduced else "cuda"
        cfg, _ = validated_config(list(overrides), 1, 1, device)
        layout = Layout.from_config(cfg, 1, device, True)
        plan = make_plan(cfg, layout)
        peak = max(st.bytes["total"] for st in plan.stages)
        step = predict(cfg, layout, plan.stages, profile, 1).step_s if profile else None
        return peak, step
    except Exception:  # a figure for the report, never a reason to stop
        return None, None


def _table_profile(gpu: Optional[str], reduced: bool):
    from megalite.plan.devices import device_profile, table_entry_for

    if reduced or not gpu:
        return device_profile("cpu") if reduced else None
    return table_entry_for(gpu)


def _checkout() -> Optional[Path]:
    """The checkout holding tests/ (the working directory's, else this package's)."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "tests" / "unit").is_dir():
            return root
    return None


def _slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


# --- the command ---------------------------------------------------------------------------

def add_arguments(p) -> None:
    p.add_argument("--out", default=None,
                   help="the report's directory (default gpu-report/<UTC time>)")
    p.add_argument("--budget-s", type=float, default=345.0,
                   help="the whole command's seconds: each run's limit is cut to what is left "
                   "(default 345: a GPU lent for 15 minutes, start-up included)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, run in this order of priority: {','.join(PARTS)}")
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
    unknown = [p for p in args.parts.split(",") if p not in PARTS]
    if unknown:
        raise SystemExit(f"megalite-bench gpu: --parts {','.join(unknown)}: not one of "
                         f"{','.join(PARTS)}")
    if args.out is None:
        args.out = f"gpu-report/{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    bench = GpuBench(args)
    chosen = [p for p in PARTS if p in args.parts.split(",")]
    for name in chosen:
        part = bench.report.part(name)
        part.limit_s = _part_limit(bench.sizes, name)
    bench.report.write()
    print(f"megalite-bench gpu: {', '.join(chosen)} within {args.budget_s:.0f} s -> "
          f"{bench.out}/report.md", flush=True)
    for name in chosen:
        part = bench.report.parts[name]
        if bench.remaining() < 5:
            part.status = "cut: the budget ran out"
            continue
        t0 = time.monotonic()
        print(f"megalite-bench gpu: {name} (limit {part.limit_s:.0f} s, "
              f"{bench.remaining():.0f} s left)", flush=True)
        try:
            getattr(bench, name.replace("-", "_"))(part)
            if part.status == "not run":
                part.status = "ok"
        except Exception as e:  # one part's fault is that part's row, not the end
            part.status = f"failed: {e!r}"
        part.seconds = time.monotonic() - t0
        bench.report.write()
        print(f"megalite-bench gpu: {name}: {part.status} ({part.seconds:.0f} s)", flush=True)
    bench.report.write()
    body = json.loads((bench.out / "report.json").read_text())
    print((bench.out / "report.md").read_text(), flush=True)
    return body


def _part_limit(s: Sizes, name: str) -> float:
    """A part's limit: the sum of its runs' (each also cut by the budget)."""
    if name == "mfu":
        return sum(s.limits[f"{r.path}-compiled" if r.compile else r.path] for r in mfu_specs(s))
    if name == "rerun":
        return 2 * s.limits["rerun"]
    return s.limits[name]
