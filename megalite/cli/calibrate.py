"""`scripts/plan.py --calibrate [--output FILE] [overrides]` (`megalite-plan --calibrate`):
every rank measures the machine (`megalite.plan.calibrate`), rank 0 writes the device profile
and prints what it measured."""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from megalite.cli.launch_env import export_launch_env, launch_env
from megalite.cli.refusal import say
from megalite.config.errors import ConfigError
from megalite.config.schema import check_sections, load_config
from megalite.plan.calibrate import CalibrationError, TableLinks, measure_profile
from megalite.plan.profile_file import save_profile


def summary(profile: dict, path: str) -> str:
    """What was measured, for the console: rates, links, the sweep, the notes."""
    gib = profile["memory_bytes"] / 2 ** 30
    lines = [f"megalite: device profile {profile['name']} -> {path}",
             f"  device: {profile['device']}, {gib:.1f} GiB a rank, "
             f"{profile['gpus_per_node']} ranks a node",
             "  matmul TFLOP/s: " + ", ".join(f"{d} {r:.3g}"
                                              for d, r in profile["matmul_tflops"].items())]
    if "hbm_gbps" in profile:
        lines.append(f"  HBM {profile['hbm_gbps']:.0f} GB/s; pinned copies "
                     f"{profile['host_link']['h2d_gbps']:.1f} GB/s host -> device, "
                     f"{profile['host_link']['d2h_gbps']:.1f} GB/s device -> host; host AdamW "
                     f"{profile['host_adam']['params_per_s']:.3g} parameters/s on "
                     f"{profile['host_adam']['threads']} threads a node")
    for link, fit in profile["links"].items():
        lines.append(f"  {link}: {fit['bus_gbps']:.3g} GB/s bus bandwidth, "
                     f"{fit['latency_s'] * 1e6:.3g} us latency")
    if profile["sweep"]:
        lines.append(f"  {'link':<11} {'op':<15} {'ranks':>5} {'bytes':>10} {'seconds':>10} "
                     f"{'bus GB/s':>9}")
    for e in profile["sweep"]:
        lines.append(f"  {e.get('link', ''):<11} {e['op']:<15} {e['group_size']:>5} "
                     f"{e['bytes']:>10} {e['seconds']:>10.3g} {e['bus_gbps']:>9.3g}")
    return "\n".join(lines + [f"  note: {n}" for n in profile.get("notes", [])])


def calibrate_command(overrides: Sequence[str], output: str,
                      table_links: Optional[TableLinks] = None) -> int:
    """`scripts/plan.py --calibrate [--output FILE] [overrides]`: every rank measures, rank 0
    writes the file and prints what it measured. Returns the exit status (2: bad input)."""
    try:
        cfg = load_config(list(overrides))
        check_sections(cfg)  # the model's and batch's sizes (the layout is not calibrated)
        export_launch_env(launch_env(gpus=torch.cuda.device_count()
                                     if torch.cuda.is_available() else None))
    except ConfigError as e:
        say(f"megalite: bad configuration: {e}")  # once a node under torchrun
        return 2
    tokens = cfg.train.seq_len * cfg.train.micro_batch_size
    try:
        profile = measure_profile(cfg.model.n_embd, cfg.model.ffn_size, tokens, table_links,
                                  (cfg.model, cfg.train.seq_len, cfg.train.micro_batch_size,
                                   cfg.train.compile))
    except CalibrationError as e:
        say(f"megalite: calibration: {e}")
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        written = save_profile(output, profile)
        print(summary(written, output))
    return 0
