"""`megalite-plan --moe-imbalance-from RUN_DIR`: planner.moe_imbalance measured by a run
(`megalite.plan.expert_time`'s f) from its metrics.jsonl."""
from __future__ import annotations

import json

from megalite.train.metrics_file import metric, metrics_path


def imbalance_from_run(run_dir) -> float:
    """The mean over the logged steps of the worst MoE layer's imbalance (the "moe" figures:
    max / mean of the step's per-expert counts over the stage, `megalite.model.moe.step`).
    That is an expert's imbalance; an EP rank holding E/ep experts averages over them, so it
    bounds the rank's from above (equal at ep = E). ValueError naming the file when it holds
    no MoE figures (its MetricsFileError without a metrics.jsonl)."""
    path = metrics_path(run_dir)
    values = []
    with open(path) as f:
        for line in f:
            value = metric(json.loads(line), "moe_imbalance") if line.strip() else None
            if value is not None:
                values.append(value)
    if not values:
        raise ValueError(f"{path}: no MoE figures (\"moe\": {{layer: {{imbalance}}}}) logged; "
                         "give an MoE run's directory, or set planner.moe_imbalance=F")
    return sum(values) / len(values)


def measured_override(run_dir) -> str:
    """The override `planner.moe_imbalance=F` of `imbalance_from_run` (at least 1)."""
    return f"planner.moe_imbalance={max(1.0, imbalance_from_run(run_dir)):.6g}"
