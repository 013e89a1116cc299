"""The planner on the GPT models of Narayanan et al. 2021, Table 1 (1.7B ... 1T parameters on
32 ... 3,072 A100-80GB GPUs of Selene: 8 per node, 8×200 Gb/s InfiniBand): for each row the
layout `scripts/plan.py --search` picks (full recompute held fixed, as in the paper; sequence
2048, vocabulary 51,200, the paper's global batch), its predicted hardware TFLOP/s per GPU
(recompute's forward counted, as the paper counts), next to the paper's layout predicted by
the same model (data-parallel all-reduce, no SP, micro-batch 1: Table 1 does not list the
micro-batch size; 1 is an assumption) and the paper's measured TFLOP/s per GPU.
No device is used: this is arithmetic on the device table (or --profile)."""
from __future__ import annotations

import argparse
import time

from megalite.config.layout import Layout
from megalite.config.schema import load_config
from megalite.plan.devices import device_profile, load_profile_file
from megalite.plan.memory import GIB, make_plan
from megalite.plan.search import NothingFits, search
from megalite.plan.time_model import predict

# params (B), heads, hidden, layers, tp, pp, GPUs, batch, measured TFLOP/s per GPU
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="a100-80gb", help="device profile name")
    p.add_argument("--profile", default=None, help="a calibrated profile file instead")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--rows", type=int, default=len(TABLE1), help="the first N rows")


def table1_overrides(heads, hidden, layers, batch):
    return [f"model.n_layer={layers}", f"model.n_embd={hidden}", f"model.n_head={heads}",
            "model.vocab_size=51200", "model.n_positions=2048", "train.seq_len=2048",
            f"train.global_batch_size={batch}", "train.recompute=true", "model.resid_pdrop=0",
            "model.embd_pdrop=0", "model.attn_pdrop=0", f"model.name=gpt-{layers}x{hidden}"]


def run(args) -> None:
    profile = load_profile_file(args.profile) if args.profile else device_profile(args.device)
    print(f"device: {profile.name} ({profile.source}), {args.gpus_per_node} per node")
    print("| params | GPUs | batch | planner's pick (tp pp dp zero sp v mb) | GiB | pred. hw "
          "TFLOP/s | pick with zero 0, no SP (offloads allowed) | pred. hw TFLOP/s | "
          "paper layout (tp pp, mb 1) | pred. hw TFLOP/s | paper measured | search s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for params, heads, hidden, layers, tp, pp, gpus, batch, measured in TABLE1[:args.rows]:
        overrides = table1_overrides(heads, hidden, layers, batch)
        cfg = load_config(overrides)
        t0 = time.perf_counter()
        full = {"recompute": True, "recompute_layers": None}  # full recompute, as the paper
        pick, pick_tf, gib = _pick(cfg, gpus, profile, args.gpus_per_node, full)
        seconds = time.perf_counter() - t0
        old, old_tf, _ = _pick(cfg, gpus, profile, args.gpus_per_node,
                               {**full, "zero": 0, "sp": False})
        paper = load_config(overrides + [f"tp={tp}", f"pp={pp}", "train.micro_batch_size=1"])
        layout = Layout.from_config(paper, gpus, "cuda")
        plan = make_plan(paper, layout)
        paper_tf = predict(paper, layout, plan.stages, profile,
                           args.gpus_per_node).hardware_tflops_per_device
        fits = "" if plan.peak.bytes["total"] <= profile.memory_bytes else \
            f" (plans {plan.peak.bytes['total'] / GIB:.0f} GiB)"
        print(f"| {params}B | {gpus} | {batch} | {pick} | {gib:.0f} | {pick_tf:.0f} | {old} | "
              f"{old_tf:.0f} | {tp} {pp}{fits} | {paper_tf:.0f} | {measured} | {seconds:.1f} |",
              flush=True)


def _pick(cfg, gpus, profile, per_node, fixed):
    """(layout, predicted hardware TFLOP/s per GPU, GiB) of the search's best."""
    try:
        best = search(cfg, gpus, profile, per_node, top=1, fixed=fixed).best[0]
    except NothingFits:
        return "nothing fits", float("nan"), float("nan")
    c = best.choice
    pick = (f"{c.tp} {c.pp} {c.dp} {c.zero} {'y' if c.sp else 'n'} {c.virtual_stages} "
            f"{c.micro_batch_size}" + (f" {c.schedule}" if c.zero_bubble else "")
            + (" +offload.activations" if c.offload else "")
            + (f"({c.offload_layers})" if c.offload_layers else "")
            + (f" +offload.optimizer={c.offload_optimizer:g}" if c.offload_optimizer else ""))
    return pick, best.prediction.hardware_tflops_per_device, best.peak_bytes / GIB
