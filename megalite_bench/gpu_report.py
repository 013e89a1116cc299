"""`megalite-bench gpu`'s report: the parts' rows written as they come to report.json and
report.md, the machine and versions in the header; each part's section written to
sections/<part>.json the moment the part ends, so that a run cut short (a machine lost) keeps
every part it finished and `--resume DIR` runs only the parts without a section."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional

from megalite_bench.gpu_sizes import PARTS

SECTIONS = "sections"  # DIR/sections/<part>.json: one finished part each

@dataclass
class Part:
    name: str
    limit_s: float = 0.0
    status: str = "not run"
    seconds: float = 0.0
    rows: List[dict] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    commands: List[str] = field(default_factory=list)
    device: Optional[str] = None  # the GPU it ran on (a resumed run may be on another)
    finished: Optional[str] = None  # UTC time its section was written


class Report:
    """report.json and report.md in `out`, rewritten after every row, assembled from the
    finished parts' sections (sections/<part>.json) and the parts still running, in the
    order of `PARTS`."""

    def __init__(self, out: Path, header: dict):
        self.out, self.header = out, header
        self.gpu = header.get("gpu")  # this machine's (the header may be a resumed run's)
        self.parts: Dict[str, Part] = {}
        out.mkdir(parents=True, exist_ok=True)

    def part(self, name: str) -> Part:
        return self.parts.setdefault(name, Part(name))

    def write(self) -> None:
        order = sorted(self.parts.values(), key=lambda p: PARTS.index(p.name)
                       if p.name in PARTS else len(PARTS))
        body = {"header": self.header, "parts": [vars(p) for p in order]}
        _atomic(self.out / "report.json", json.dumps(body, indent=1, default=str) + "\n")
        _atomic(self.out / "report.md", render_markdown(body))

    def write_section(self, part: Part) -> None:
        """`part` ended: its section, atomically (a reader sees the old file or the whole new
        one, never a part of it), then the report."""
        part.device = self.gpu
        part.finished = datetime.now(timezone.utc).isoformat(timespec="seconds")
        (self.out / SECTIONS).mkdir(exist_ok=True)
        _atomic(self.out / SECTIONS / f"{part.name}.json",
                json.dumps(vars(part), indent=1, default=str) + "\n")
        self.write()

    def resume(self) -> List[str]:
        """Take up the report in `out`: its first header (this machine's added under
        `resumed`) and its finished parts' sections; returns their names."""
        previous = self.out / "report.json"
        if previous.is_file():
            first = json.loads(previous.read_text())["header"]
            now = {k: self.header.get(k) for k in ("started", "gpu", "host", "megalite")}
            self.header = {**first, "resumed": [*first.get("resumed", []), now]}
        done = []
        for path in sorted((self.out / SECTIONS).glob("*.json")):
            part = Part(**json.loads(path.read_text()))
            self.parts[part.name] = part
            done.append(part.name)
        return done


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
        where = f", on {p['device']}" if p.get("device") and p["device"] != h.get("gpu") \
            else ""
        lines += ["", f"## {p['name']} — {p['status']} ({p['seconds']:.0f} s of a "
                  f"{p['limit_s']:.0f} s limit{where})", ""]
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
    root = Path(__file__).resolve().parents[1]  # the checkout holding megalite_bench/
    if (root / ".git").exists() and shutil.which("git"):
        try:
            commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()
            v += f" ({root}: {commit})"
        except (OSError, subprocess.SubprocessError):
            pass
    return v
