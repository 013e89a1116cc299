#!/usr/bin/env python
"""Benchmarks, each side by side with a reference in the same run (ratios, not absolute times).

    python scripts/bench.py train --presets tiny gpt2 --seq-len 256 --micro-batch 4 --steps 8

`train`: training tokens/s of megalite's GPT-2 against `transformers.GPT2LMHeadModel` doing the
same steps — same weights, batches, shapes, AdamW (same groups and implementation), grad-norm
clipping — at tp = pp = dp = 1. Steps alternate between the two models so machine noise hits
both alike; the median step time of each is reported, and the ratio megalite / HF (> 1 = megalite
faster).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from megalite.config import load_config  # noqa: E402
from megalite.model.gpt2 import GPT2, flops_per_token  # noqa: E402
from megalite.model.hf import from_hf_state_dict, hf_config  # noqa: E402
from megalite.train.metrics import peak_tflops  # noqa: E402
from megalite.train.optim import build_optimizer  # noqa: E402


def _step(model, optimizer, x, y, hf: bool, autocast) -> float:
    t0 = time.perf_counter()
    with autocast():
        loss = model(input_ids=x, labels=y).loss if hf else model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_train(args) -> None:
    from transformers import GPT2LMHeadModel

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = (lambda: torch.autocast("cuda", dtype=dtype)) if dtype != torch.float32 \
        else (lambda: torch.autocast("cpu", enabled=False))
    peak = peak_tflops(device, None)
    print(f"device={device} threads={torch.get_num_threads()} peak={peak.tflops} TFLOP/s "
          f"({peak.source})")
    print(f"{'preset':<8} {'seq':>5} {'mb':>3} {'megalite tok/s':>15} {'HF tok/s':>10} "
          f"{'ratio':>6} {'megalite TFLOP/s':>17}")
    for preset in args.presets:
        mcfg = load_config([f"model={preset}"]).model
        seq = min(args.seq_len, mcfg.n_positions)
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(hf_config(mcfg)).to(device)
        hf.config._attn_implementation = "sdpa"
        ours = GPT2(mcfg).to(device)
        ours.load_state_dict(from_hf_state_dict(hf.state_dict()))
        opt_ours = build_optimizer(ours, load_config().optim, device)
        opt_hf = build_optimizer(hf, load_config().optim, device)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, mcfg.vocab_size, (args.micro_batch, seq + 1), generator=g)
                   .to(device) for _ in range(args.warmup + args.steps)]
        times = {"megalite": [], "hf": []}
        for i, batch in enumerate(batches):
            x, y = batch[:, :-1], batch[:, 1:]
            order = [("megalite", ours, opt_ours), ("hf", hf, opt_hf)]
            for name, model, opt in (order if i % 2 == 0 else order[::-1]):
                # HF shifts labels itself: give it the inputs as labels.
                t = _step(model, opt, x, x if name == "hf" else y, name == "hf", autocast)
                if i >= args.warmup:
                    times[name].append(t)
        tokens = args.micro_batch * seq
        tps = {k: tokens / statistics.median(v) for k, v in times.items()}
        tflops = tps["megalite"] * flops_per_token(mcfg, seq) / 1e12
        print(f"{preset:<8} {seq:>5} {args.micro_batch:>3} {tps['megalite']:>15.0f} "
              f"{tps['hf']:>10.0f} {tps['megalite'] / tps['hf']:>6.3f} {tflops:>17.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    train = sub.add_parser("train", help="tokens/s against transformers.GPT2LMHeadModel")
    train.add_argument("--presets", nargs="+", default=["tiny", "gpt2"])
    train.add_argument("--seq-len", type=int, default=256)
    train.add_argument("--micro-batch", type=int, default=4)
    train.add_argument("--steps", type=int, default=8)
    train.add_argument("--warmup", type=int, default=2)
    train.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    train.set_defaults(fn=bench_train)
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
