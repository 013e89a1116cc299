"""What a verdict of `megalite.resilience.rerun` leaves behind, under `<run dir>/resilience/`:

    fault.json        a hardware verdict (written atomically by rank 0, then every rank raises
                      HardwareFaultError and the process exits with HARDWARE_FAULT_EXIT):
                      {"step", "kind": transient | persistent, "rank", "node", "gpu" (the first
                      suspect), "suspects": [{rank, node, gpu}, ...], "reasons", "message"}
    data_skips.jsonl  one line per batch judged to be bad data and skipped: the step, why it
                      was suspicious, and the samples ([dataset, window] pairs) of the DP
                      replicas whose micro-batches were suspicious
    unresolved.jsonl  one line per reproducible suspicious step that could not be told apart
                      (dp = 1: no other replica to recompute on); skipped like bad data

`scripts/slurm/pretrain.sbatch` watches for fault.json: it stops the job step (torchrun would
otherwise restart the workers on the same nodes) and exits with HARDWARE_FAULT_EXIT. While
fault.json exists, `scripts/pretrain.py` with that run directory refuses to start (exit
HARDWARE_FAULT_EXIT, naming the file: `megalite.cli.fault_exit`), so a restart or requeue on the same
node does not train on the faulty device. To clear it, once the node is excluded or repaired:
move the file aside (`mv <run dir>/resilience/fault.json <run dir>/resilience/fault-<date>.json`,
what pretrain.sbatch does on an allocation without the node) and start again.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import List

from megalite.utils.durable import fsync_dir

# EX_TEMPFAIL of sysexits.h: retry, elsewhere. Also the code of pretrain.sbatch on a fault.
HARDWARE_FAULT_EXIT = 75
FAULT_FILE = "fault.json"


class HardwareFaultError(RuntimeError):
    """A suspicious step was attributed to a device (raised on every rank alike)."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


def resilience_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "resilience"


def fault_record(step: int, kind: str, suspects: List[int], places: List[tuple],
                 reasons: List[str], message: str) -> dict:
    """fault.json's content: `places[r]` = (host, CUDA index or None) of global rank r."""
    named = [{"rank": r, "node": places[r][0], "gpu": places[r][1]} for r in suspects]
    return {"step": step, "kind": kind, **named[0], "suspects": named, "reasons": reasons,
            "message": message, "time": time.time()}


def write_fault(run_dir: Path, record: dict) -> Path:
    """fault.json, whole or not at all: written to a temporary name, flushed, renamed."""
    directory = resilience_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path, tmp = directory / FAULT_FILE, directory / f".{FAULT_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(directory)
    return path


def append_line(run_dir: Path, name: str, record: dict) -> Path:
    """One JSON line appended to `<run dir>/resilience/<name>` (flushed to disk)."""
    directory = resilience_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path
