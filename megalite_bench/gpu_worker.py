"""The benchmark path timed by phase, in a process of its own (`megalite-bench gpu` runs it
with a time limit): `bench.py train`'s model, engine and schedule (`megalite_bench.train
.megalite_parts`: GPT2 stage -> pipeline schedule -> ZeRO engine, one rank, zero 0, random
tokens already on the device), each step timed in the trainer's phases on the device's
timeline (`megalite.utils.clock`: CUDA events on a GPU) so that it compares phase by phase
with the launch path's `step_phases_s`:

    forward_backward  schedule.train_step (every micro-batch's forward and backward)
    grad_sync         engine.finish_grad_sync
    optimizer         the global norm, clipping, AdamW, zero_grad (the launch path computes
                      the norm before its optimizer phase, in the step's execution)

    python -m megalite_bench.gpu_worker --model model=gpt2-xl --micro-batch 16 \\
        --micro-batches 4 --seq-len 1024 --compile 1 --dropout 0 --steps 3 --warmup 2

Prints one JSON line: step_s and phases_s (medians of the timed steps), tokens/s, MFU, peak
device memory; or {"error": ...} when the micro-batch does not fit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from typing import List, Optional

import torch

from megalite.config.schema import load_config
from megalite.model.families import flops_per_token
from megalite.train.metrics import peak_memory_bytes, peak_tflops
from megalite.utils.clock import DeviceClock
from megalite_bench.train import megalite_parts, random_batches

PHASES = ("data", "forward_backward", "grad_sync", "optimizer")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["model=gpt2"],
                   help="model overrides (a preset and/or model.* keys)")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--compile", type=int, default=0, choices=[0, 1])
    p.add_argument("--dropout", type=float, default=0.0,
                   help="resid, embd and attn dropout (bench.py train's --dropout)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="MFU's denominator (default: the device table's; on CPU measured)")
    return p


def measure(args) -> dict:
    device = torch.device(args.device)
    mcfg = replace(load_config(list(args.model)).model, resid_pdrop=args.dropout,
                   embd_pdrop=args.dropout, attn_pdrop=args.dropout)
    seq = min(args.seq_len, mcfg.n_positions)
    schedule, engine = megalite_parts(mcfg, device, args.micro_batch, seq, False,
                                      bool(args.compile))
    batches = random_batches(mcfg.vocab_size, args.micro_batch, seq, args.micro_batches, device)
    clock = DeviceClock(device)
    steps: List[dict] = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        marks = [clock.mark()]
        schedule.train_step(batches)
        marks.append(clock.mark())
        engine.finish_grad_sync()
        marks.append(clock.mark())
        engine.clip_and_step(1e-4, 1.0)
        engine.zero_grad()
        marks.append(clock.mark())
        if i >= args.warmup:
            spans = [clock.seconds(a, b) for a, b in zip(marks, marks[1:])]
            steps.append({"data": 0.0, "forward_backward": spans[0], "grad_sync": spans[1],
                          "optimizer": spans[2], "step": sum(spans)})
    step_s = statistics.median(s["step"] for s in steps)
    tokens = args.micro_batch * seq * args.micro_batches
    peak = peak_tflops(device, args.peak_tflops)
    fpt = flops_per_token(mcfg, seq)
    return {"step_s": step_s, "steps_s": [s["step"] for s in steps],
            "phases_s": {p: statistics.median(s[p] for s in steps) for p in PHASES},
            "tokens_per_s": tokens / step_s,
            "mfu": tokens / step_s * fpt / (peak.tflops * 1e12) if peak.tflops else None,
            "memory": peak_memory_bytes(device),
            "dropout_on": args.dropout > 0, "device": str(device)}


def main(argv: Optional[List[str]] = None) -> None:
    args = parser().parse_args(argv)
    try:
        row = measure(args)
    except torch.OutOfMemoryError as e:
        row = {"error": f"out of memory: {str(e).splitlines()[0]}"}
    print(json.dumps(row), flush=True)
    sys.exit(0 if "error" not in row else 3)


if __name__ == "__main__":
    main()
