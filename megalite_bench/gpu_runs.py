"""Running `megalite-bench gpu`'s commands with a time limit (a subprocess group, killed at the
limit or stopped once it has printed enough) and reading what they print: pytest's counts,
JSON lines, a launch's metrics.jsonl."""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from megalite_bench.gpu_sizes import PHASES


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
    if group_members(proc.pid):  # the launcher ended, a worker lives on: the same GPU memory
        _kill_group(proc)
    reader.join(timeout=5)
    output = "".join(lines)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {' '.join(map(str, cmd))}\n{output}")
    return Ran(None if timed_out or stopped else proc.returncode, time.monotonic() - t0,
               output, timed_out, stopped)


def _kill_group(proc: subprocess.Popen, gone_within_s: float = 60.0) -> None:
    """SIGKILL the run's whole process group and wait until none of its processes is alive.
    Waiting for the launcher alone is not enough: torchrun's workers are reparented when it
    dies and release their GPU memory as they exit, so the next run would start beside a
    dying rank's 69 GiB (seen on an H200: the next gpt2-xl run out of memory at its first
    backward)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + gone_within_s
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def group_members(pgid: int) -> List[int]:
    """The live (not zombie) processes of process group `pgid`, read from /proc (Linux)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process exited while we looked
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


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
