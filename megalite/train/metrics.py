"""What a run reports: throughput, TFLOP/s, MFU, memory, communication; jsonl + wandb + console.

MFU = achieved model FLOP/s per device / peak FLOP/s per device (Chowdhery et al. 2022, App. B),
with model FLOPs per token from `megalite.model.gpt2.flops_per_token` (6N + 12·L·h·s). The peak
comes from, in order: `log.peak_tflops`; a table of known accelerators (dense bf16 tensor-core
peaks from the vendors' data sheets, the device table of `megalite.plan.devices`
(shared with the planner)); on CPU a measured fp32 matmul peak. An unknown accelerator
gets no number: MFU is reported as null rather than against a guess. An FP8 run's MFU is
against the same dense bf16 peak, its dense FP8 peak named beside it (the header's `fp8`).
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch

from megalite.plan.devices import table_peak_tflops
from megalite.utils.log import get_logger


@dataclass
class Peak:
    tflops: Optional[float]
    source: str


def measure_cpu_matmul_tflops(n: int = 2048, repeats: int = 4) -> float:
    """Best-of-`repeats` fp32 matmul throughput of this process's CPU threads, in TFLOP/s."""
    g = torch.Generator().manual_seed(0)  # never touch the training RNG streams
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b  # warm up the BLAS threads
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def table_peak(device_name: str) -> Peak:
    """The data-sheet peak of the device table entry (`megalite.plan.devices`, the one
    table the planner uses too) whose name appears in `device_name` as whole words."""
    tflops, key = table_peak_tflops(device_name)
    if tflops is not None:
        return Peak(tflops, f"table: {device_name} dense bf16 ({key})")
    return Peak(None, f"unknown device {device_name!r}: set log.peak_tflops to report MFU")


def fp8_peak(recipe: str, device: torch.device) -> Optional[dict]:
    """An FP8 run's header entry: the recipe and the device's dense FP8 data-sheet peak, named
    beside MFU, which stays against the dense bf16 peak (`peak_tflops_per_device`) so that
    FP8 and bf16 runs compare; None without FP8."""
    if recipe == "none":
        return None
    if device.type != "cuda":
        return {"recipe": recipe, "peak_tflops_fp8": None, "mfu_against": "bf16 peak",
                "source": f"{device.type}: FP8 emulated (fp8.emulate), no FP8 peak"}
    name = torch.cuda.get_device_name(device)
    tflops, key = table_peak_tflops(name, "fp8")
    return {"recipe": recipe, "peak_tflops_fp8": tflops, "mfu_against": "bf16 peak",
            "source": f"table: {name} dense FP8 ({key})" if tflops is not None
            else f"no FP8 peak in the device table for {name!r}"}


def peak_tflops(device: torch.device, override: Optional[float]) -> Peak:
    if override is not None:
        return Peak(override, "config log.peak_tflops")
    if device.type == "cuda":
        return table_peak(torch.cuda.get_device_name(device))
    if device.type == "cpu":
        n = 2048
        return Peak(measure_cpu_matmul_tflops(n),
                    f"measured: best fp32 {n}x{n} matmul on CPU, {torch.get_num_threads()} threads")
    return Peak(None, f"unknown device type {device.type!r}: set log.peak_tflops")


def peak_memory_bytes(device: torch.device) -> Dict[str, int]:
    """Peak accelerator memory allocated by tensors; on CPU the process's peak RSS."""
    if device.type == "cuda":
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024}


def throughput(tokens: int, seconds: float, flops_per_token: int, world_size: int,
               peak: Peak) -> Dict[str, Optional[float]]:
    """tokens/s over the whole job, model TFLOP/s per device and MFU (null without a peak)."""
    tokens_per_s = tokens / seconds
    tflops = tokens_per_s * flops_per_token / world_size / 1e12
    return {"tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
            "mfu": tflops / peak.tflops if peak.tflops else None}


def attention_flops(per_pair: int, visible_pairs: float, sequences: int, seq_len: int,
                    steps: int) -> Dict[str, float]:
    """Per step, the attention FLOPs computed under train.attention_mask=document (12·L·h per
    (query, key) pair the mask leaves: Σ over documents of n(n+1)/2 pairs) beside the ones MFU
    counts (the dense 12·L·h·s per token of `flops_per_token`, whatever the mask)."""
    return {"attention_flops_masked": per_pair * visible_pairs / steps,
            "attention_flops_in_mfu": per_pair * seq_len * seq_len * sequences / steps}


# jsonl key -> wandb key; the prefixes are the panel sections of a wandb workspace.
WANDB_SECTIONS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "param_norm": "train/param_norm",
    "val_loss": "val/loss", "hellaswag_acc": "val/hellaswag_acc",
    "hellaswag_acc_norm": "val/hellaswag_acc_norm", "tokens_per_s": "perf/tokens_per_s",
    "tflops_per_device": "perf/tflops_per_device", "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s", "consumed_tokens": "train/consumed_tokens",
    "predicted_step_time_s": "perf/predicted_step_time_s",
    "pipeline_bubble": "perf/pipeline_bubble",
    "pipeline_bubble_expected": "perf/pipeline_bubble_expected",
    "pipeline_in_flight": "perf/pipeline_in_flight",
    "checkpoint_blocked_s": "perf/checkpoint_blocked_s",
    "attention_flops_masked": "perf/attention_flops_masked",
    "attention_flops_in_mfu": "perf/attention_flops_in_mfu",
}


def strict_json(value):
    """NaN and inf (a diverged step's grad_norm) as null: metrics.jsonl stays standard JSON that
    jq and other strict parsers read."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def wandb_row(record: dict) -> dict:
    """Flatten one metrics.jsonl record into wandb keys: train/*, val/*, perf/*,
    perf/phase/<phase>_s, memory/*, comm/<group>/<op>_bytes, moe/<block>/<figure>, perf/stragglers (how many a
    straggler report named) and perf/compute_median/<phase>_s."""
    row = {}
    for key, value in record.items():
        if key == "step" or value is None:
            continue
        if key == "memory":
            row.update({f"memory/{k}": v for k, v in value.items()})
        elif key == "step_phases_s":
            row.update({f"perf/phase/{k}_s": v for k, v in value.items()})
        elif key == "straggler_report":
            row["perf/stragglers"] = len(value["stragglers"])
            row.update({f"perf/compute_median/{k}_s": v
                        for k, v in value["median_compute_s"].items()})
        elif key == "moe":  # per MoE layer: moe/<block>/<figure>; the pooled aux apart
            for layer, figures in value.items():
                if isinstance(figures, dict):
                    row.update({f"moe/{layer}/{k}": v for k, v in figures.items()})
                else:
                    row[f"moe/{layer}"] = figures
        elif key == "comm":
            for name, counts in value.items():
                row[f"comm/{name}_bytes"] = counts["bytes"]
                row[f"comm/{name}_wire_bytes"] = counts["wire_bytes"]
        else:
            row[WANDB_SECTIONS.get(key, f"train/{key}")] = value
    return row


def wandb_mode(setting: str) -> Optional[str]:
    """log.wandb -> wandb mode: auto = online when credentials exist, else offline (into the
    run directory)."""
    if setting == "false":
        return None
    if setting in ("true", "offline"):
        return "online" if setting == "true" else "offline"
    netrc = Path(os.path.expanduser("~/.netrc"))
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (
        netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore"))
    return "online" if has_key else "offline"


class MetricsWriter:
    """Rank 0's sink: `<run dir>/metrics.jsonl` (a header line, then one line per log step),
    the same values to wandb, and a console progress bar."""

    def __init__(self, run_dir: Path, header: dict, wandb_setting: str, project: str,
                 run_name: Optional[str], config: dict, total_steps: int, start_step: int,
                 progress: bool):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        with open(self.path, "a") as f:
            f.write(json.dumps(strict_json({"run": header}), allow_nan=False) + "\n")
        self.wandb_run = self._start_wandb(wandb_setting, project, run_name, config, header)
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True)

    def _start_wandb(self, setting, project, run_name, config, header):
        mode = wandb_mode(setting)
        if mode is None:
            return None
        import wandb

        def init(m):
            return wandb.init(project=project, name=run_name, dir=str(self.run_dir), mode=m,
                              config={"megalite": config, "run": header}, reinit="finish_previous",
                              settings=wandb.Settings(init_timeout=60, silent=True,
                                                      console="off"))
        try:
            return init(mode)
        except Exception as e:  # network trouble must never stop training
            if mode == "offline":
                raise
            get_logger().warning(f"wandb online init failed ({e}); logging offline into "
                                 f"{self.run_dir}")
            return init("offline")

    def log(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(wandb_row(record), step=record["step"])
        if self.bar is not None:
            self.bar.n = record["step"]
            shown = {"loss": record.get("loss"), "val": record.get("val_loss"),
                     "tok/s": record.get("tokens_per_s"), "mfu": record.get("mfu")}
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items() if v is not None},
                                 refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
