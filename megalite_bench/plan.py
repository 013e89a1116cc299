"""The planner's predicted step time against measured ones on this machine: for each layout,
the median seconds per training step of the real training path (gloo ranks, pipeline schedule,
ZeRO engine) next to `megalite.plan.time_model.predict` for it, their ratio, and the rank
correlation (Spearman) of the two orders — all layouts measured in the same run.

The device profile: `--profile FILE` (`scripts/plan.py --calibrate` on the same machine and
model shapes), else the built-in `cpu` table entry (a rough one-core guess: expect its absolute
times to be off). Layouts with `--world` ranks run
in one gloo world, the single-rank ones in another. The data: `--data`, or a small corpus of
Python's standard library prepared into a temporary directory first.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import List, Sequence

from megalite.testing.spawn import run_ranks
from megalite_bench.on_off import prepared_corpus

LAYOUTS_2 = ["tp=2", "tp=2,sp=true", "pp=2,train.micro_batch_size=8", "pp=2", "zero=0",
             "zero=1", "zero=3", "zero=1,train.recompute=true",
             "zero=1,train.micro_batch_size=4"]
LAYOUTS_1 = ["zero=0", "zero=0,train.micro_batch_size=8,train.recompute=true"]


def _overrides(args, layout: List[str], data: str, run_dir: str) -> List[str]:
    return [*[f"model.{kv}" for kv in args.model], f"data.dir={data}", "device=cpu",
            f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.global_batch}", "train.max_steps=1000000",
            "train.eval_every=0", "log.wandb=false", "log.progress=false",
            "log.peak_tflops=1", f"checkpoint.dir={run_dir}/ckpt", "resilience.check_every=0",
            "resilience.straggler_report_every=0", *layout]


def _measure(rank: int, world: int, args, layouts: List[List[str]], data: str, root: str):
    from megalite.config.schema import load_config
    from megalite.train.launch import launch

    out = []
    for i, layout in enumerate(layouts):
        cfg = load_config(_overrides(args, layout, data, f"{root}/{world}-{i}"))
        trainer = launch(cfg, world, Path(root) / f"{world}-{i}").trainer
        times = []
        for n in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            trainer.train_step()  # ends with a host read of the gradient norm
            if n >= args.warmup:
                times.append(time.perf_counter() - t0)
        out.append({"layout": layout, "world": world, "median_s": statistics.median(times)})
    return out


def _profile(args):
    from megalite.plan.devices import device_profile, load_profile_file

    if args.profile:
        return load_profile_file(args.profile), f"--profile {args.profile}"
    return device_profile("cpu"), "built-in cpu entry (calibrate with scripts/plan.py " \
        "--calibrate and pass --profile FILE)"


def _predicted(args, res: dict, data: str, profile) -> float:
    """The predicted step time of a measured layout on `profile`."""
    from megalite.config.layout import Layout
    from megalite.config.schema import load_config
    from megalite.plan.memory import make_plan
    from megalite.plan.time_model import predict

    cfg = load_config(_overrides(args, res["layout"], data, "/tmp/unused"))
    layout = Layout.from_config(cfg, res["world"], "cpu")
    return predict(cfg, layout, make_plan(cfg, layout).stages, profile, res["world"]).step_s


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Rank correlation (ties get their average rank)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / den if den else float("nan")


def add_arguments(parser) -> None:
    parser.add_argument("--model", nargs="*", default=["n_layer=4", "n_embd=128", "n_head=4",
                                                       "n_positions=128", "vocab_size=1024",
                                                       "resid_pdrop=0", "embd_pdrop=0",
                                                       "attn_pdrop=0"],
                        metavar="KEY=VALUE", help="model overrides")
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS_2,
                        help="comma-separated overrides per layout on --world ranks")
    parser.add_argument("--single", nargs="*", default=LAYOUTS_1,
                        help="comma-separated overrides per single-rank layout")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", default=None, help="a calibrated device profile file")
    parser.add_argument("--data", default=None, help="a prepared data directory")


def run(args) -> None:
    profile, source = _profile(args)
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(prepared_corpus(Path(tmp)))
        results = run_ranks(_measure, args.world, args=(
            args, [s.split(",") for s in args.layouts], data, tmp), timeout_s=3600)[0]
        if args.single:
            results += run_ranks(_measure, 1, args=(
                args, [s.split(",") for s in args.single], data, tmp), timeout_s=3600)[0]
        predicted = [_predicted(args, r, data, profile) for r in results]
        # the same measurements against the model without the calibrated non_matmul term
        # and per-kind link fits (the model before they were added)
        flops_only = replace(profile, block_fits=(), op_links={})
        without = [_predicted(args, r, data, flops_only) for r in results]
    measured = [r["median_s"] for r in results]
    print(f"model {' '.join(args.model)}, seq {args.seq_len}, global batch "
          f"{args.global_batch}; {args.steps} timed steps per layout (median); profile: "
          f"{source}")
    print("| ranks | layout | measured ms/step | predicted ms/step | predicted / measured | "
          "without non_matmul, op_links ms/step | without / measured |")
    print("|---|---|---|---|---|---|---|")
    for r, m, p, w in zip(results, measured, predicted, without):
        print(f"| {r['world']} | {' '.join(r['layout'])} | {m * 1e3:.1f} | {p * 1e3:.1f} | "
              f"{p / m:.2f} | {w * 1e3:.1f} | {w / m:.2f} |")
    for name, pred in (("predicted", predicted), ("without non_matmul, op_links", without)):
        print(f"{name}: Spearman (predicted vs measured order) {spearman(pred, measured):.2f}; "
              f"within 25%: {sum(abs(p / m - 1) <= 0.25 for m, p in zip(measured, pred))}"
              f" of {len(measured)}")
