"""Reading a run's `metrics.jsonl` back (for plots and the end-of-run summary); no torch.

The file (written by `megalite.train.metrics.MetricsWriter`) holds a header line `{"run": ...}`
per launch and then one record per log step. A resumed launch appends its own header, whose
`start_step` says where it continued: records of an earlier launch after that step belong to a
line of steps the resumed run replaced (it resumed from an earlier checkpoint) and are dropped,
so `run_records` is the run's history as its last launch sees it. A fresh launch in the same
directory (start_step 0) replaces everything before it.

Metric names: a record's keys are the jsonl names (`loss`, `val_loss`, `tokens_per_s`, `mfu`,
...); `metric(record, name)` also finds a value written under its wandb name
(`val/hellaswag_acc`) or the other spelling of it, so readers do not depend on which one the
writer used.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

METRICS_FILE = "metrics.jsonl"

# the names a metric may be written under, the preferred (jsonl) one first
ALIASES: Dict[str, Tuple[str, ...]] = {
    "loss": ("loss", "train/loss"),
    "val_loss": ("val_loss", "val/loss"),
    "hellaswag_acc": ("hellaswag_acc", "val/hellaswag_acc", "val_hellaswag_acc"),
    "hellaswag_acc_norm": ("hellaswag_acc_norm", "val/hellaswag_acc_norm",
                           "val_hellaswag_acc_norm"),
    "tokens_per_s": ("tokens_per_s", "perf/tokens_per_s"),
    "mfu": ("mfu", "perf/mfu"),
    "consumed_tokens": ("consumed_tokens", "train/consumed_tokens"),
}


MOE_PREFIX = "moe_"


def _worst_layer(record: dict, figure: str) -> Optional[float]:
    """The largest `figure` over the MoE layers of `record["moe"]` (metrics.jsonl's nested
    form, or wandb's flat `moe/<block>/<figure>` keys)."""
    layers = record.get("moe")
    if isinstance(layers, dict):
        values = [f.get(figure) for f in layers.values() if isinstance(f, dict)]
    else:
        values = [v for k, v in record.items()
                  if k.startswith("moe/") and k.endswith(f"/{figure}")]
    values = [v for v in values if v is not None]
    return max(values) if values else None


class MetricsFileError(ValueError):
    """A run directory without a readable metrics.jsonl; the message names the path."""


def metric(record: dict, name: str) -> Optional[float]:
    """The value of metric `name` in `record` under any of its names; None when absent or null.
    `moe_<figure>` (an MoE run's `moe` figures, e.g. moe_imbalance): the worst (largest) over
    its MoE layers."""
    if name.startswith(MOE_PREFIX):
        return _worst_layer(record, name[len(MOE_PREFIX):])
    for key in ALIASES.get(name, (name,)):
        value = record.get(key)
        if value is not None:
            return value
    return None


def metrics_path(run_dir) -> Path:
    """`<run_dir>/metrics.jsonl`, which must exist (a run directory, or the file itself)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise MetricsFileError(
            f"{run_dir}: no {METRICS_FILE} there; give the run directory of a megalite-pretrain "
            "run (its hydra.run.dir, which holds metrics.jsonl and pretrain.log)")
    return path


def run_records(run_dir) -> Tuple[dict, List[dict]]:
    """(header of the last launch, the run's records in step order) of `run_dir`."""
    path = metrics_path(run_dir)
    header: Optional[dict] = None
    records: List[dict] = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break  # the last line of a run still writing, or killed mid-line
            raise MetricsFileError(f"{path}:{number}: not a JSON line ({e})") from e
        if "run" in entry:
            header = entry["run"]
            start = header.get("start_step", 0)
            records = [r for r in records if r["step"] <= start]
        else:
            while records and records[-1]["step"] >= entry["step"]:
                records.pop()
            records.append(entry)
    if header is None:
        raise MetricsFileError(f"{path}: no header line ({{\"run\": ...}}); not a megalite "
                               "metrics file")
    return header, records
