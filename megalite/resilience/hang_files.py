"""The files of a hang dump (`megalite.resilience.hang`): one rank's dump,
`hang/rank<r>.json` (its thread stacks and flight recorder), and the summary of a request
(`summary.txt`, `summary.json`), each written to a temporary file and renamed, so a file that
exists is complete; a previous launch's `hang/` set aside (`hang.<n>/`) before this one's dumps.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional


def dump_name(rank: int) -> str:
    return f"rank{rank:05d}.json"


def thread_stacks() -> Dict[str, List[str]]:
    """Every Python thread's stack, innermost call last, by "<name> (<ident>)"."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {f"{names.get(ident, 'thread')} ({ident})": traceback.format_stack(frame)
            for ident, frame in sys._current_frames().items()}


def write_json(path: Path, obj) -> None:
    """Write whole or not at all: a temporary file renamed over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def set_aside_old_dumps(run_dir: Path) -> Optional[Path]:
    """A previous launch's `hang/` (a reused run directory) moves to `hang.<n>/`, so that the
    dumps in `hang/` are this launch's. Rank 0, before the others can dump."""
    hang = run_dir / "hang"
    if not hang.is_dir() or not any(p.is_file() for p in hang.rglob("*")):
        return None  # (empty, or only the empty hang/nccl/ of megalite.resilience.nccl_flight)
    n = 1
    while (run_dir / f"hang.{n}").exists():
        n += 1
    hang.rename(run_dir / f"hang.{n}")
    return run_dir / f"hang.{n}"


def write_dump(out: Path, rank: int, world_size: int, req: dict, failure: bool,
               groups: dict) -> dict:
    """Write rank `rank`'s dump for `req` into `out` (whole or not at all): where it runs
    (host, pid), its flight recorder's `groups` and every thread's stack. Returns it."""
    state = {"rank": rank, "world_size": world_size, "host": socket.gethostname(),
             "pid": os.getpid(), "time": time.time(), "request": req, "failure": failure,
             "groups": groups, "stacks": thread_stacks()}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / dump_name(rank), state)
    return state


def write_summary(out: Path, text: str, summary: dict, keep_first: bool) -> Path:
    """`out`/summary.txt and summary.json, each whole or not at all. With `keep_first` (a
    failure's: two ranks may notice one failure) an existing summary is kept: the first
    rank's to notice, which is the closest to the cause."""
    out.mkdir(parents=True, exist_ok=True)
    for name, content in (("summary.json", json.dumps(summary, indent=1)),
                          ("summary.txt", text)):
        tmp = out / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(content)
        if not keep_first:
            os.replace(tmp, out / name)
            continue
        try:
            os.link(tmp, out / name)  # fails where the file exists: atomic keep-the-first
        except FileExistsError:
            pass
        tmp.unlink()
    return out / "summary.txt"


def mark_failed(out: Path, what: str) -> None:
    """Say in `out`'s summary, where one is written, that its operation failed (`what`): its
    first line and the request's `failed` field."""
    path = out / "summary.json"
    if not path.exists():
        return
    summary = json.loads(path.read_text())
    summary["request"]["failed"] = what
    text = (out / "summary.txt").read_text()
    write_summary(out, f"failed: {what}\n{text}", summary, keep_first=False)
