"""What the hang dumps' flight recorder costs (`resilience.hang_dump`, `megalite.resilience.flight`):
training steps with every collective recorded against the same steps without, side by side in
one run (on, off, off, on, ...), in a gloo world of `--world` ranks over the real training
path, with the other resilience checks off. Reported per layout, from rank 0's clock: the
median ms per step off and on and their ratio; and the cost computed exactly: the collectives
recorded per step × the measured cost of recording one (launch, wait, end, on a group of the
world), relative to a step. The watch thread runs only inside `fit` and sleeps between looks
at the store (every min(2, hang_wait_s / 4) s): not part of a step.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import List

from megalite.bench.resilience import _prepared_corpus
from megalite.spawn import run_ranks


def _overrides(args, layout: List[str], data: str, run_dir: str) -> List[str]:
    return [f"model={args.preset}", *[f"model.{kv}" for kv in args.model], f"data.dir={data}",
            "device=cpu", f"train.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.global_batch}", "train.max_steps=1000000",
            "train.eval_every=0", "log.wandb=false", "log.progress=false",
            "log.peak_tflops=1", f"checkpoint.dir={run_dir}/ckpt", "resilience.check_every=0",
            "resilience.straggler_report_every=0", "resilience.hang_dump=true", *layout]


def _recorded(recorder) -> int:
    return sum(g["started"] + g["p2p_started"] for g in recorder.snapshot())


def _seconds_per_record(recorder, group, calls: int = 20000) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        pass
    bare = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(calls):
        entry = recorder.started("all_reduce", group, 1024)
        recorder.waiting(entry)
        recorder.done(entry)
    return (time.perf_counter() - t0 - bare) / calls


def _measure(rank: int, world: int, args, layouts: List[List[str]], data: str, root: str):
    from megalite.config import load_config
    from megalite.layout import validate
    from megalite.resilience.flight import FlightRecorder
    from megalite.runtime import init_runtime
    from megalite.train.build import build_trainer

    results = []
    for i, layout in enumerate(layouts):
        cfg = load_config(_overrides(args, layout, data, f"{root}/{i}"))
        validate(cfg, world)
        trainer = build_trainer(cfg, init_runtime(cfg), Path(root) / str(i))
        counters = [trainer.topo.counter, trainer.topo.checkpoint_group.counter]
        recorder = counters[0].flight
        steps = {True: [], False: []}
        calls = []
        for n in range(args.warmup + args.steps):
            on = n % 4 in (0, 3)
            for c in counters:
                c.flight = recorder if on else None
            before = _recorded(recorder)
            t0 = time.perf_counter()
            trainer.train_step()  # ends with a host read of the gradient norm
            if n >= args.warmup:
                steps[on].append(time.perf_counter() - t0)
            if on:
                calls.append(_recorded(recorder) - before)
        per_call = _seconds_per_record(FlightRecorder(rank, cfg.resilience.hang_history),
                                       trainer.topo.world_group)
        results.append({"layout": " ".join(layout), "off": steps[False], "on": steps[True],
                        "calls": statistics.median(calls), "per_call": per_call})
    return results


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="tiny", help="model preset (conf/model)")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model overrides, e.g. n_layer=2")
    parser.add_argument("--layouts", nargs="+", default=["zero=1", "tp=2,sp=true", "pp=2"],
                        help="comma-separated overrides per layout, each on --world ranks")
    parser.add_argument("--world", type=int, default=2, help="ranks (a gloo world)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--data", default=None, help="a prepared data directory")


def run(args) -> None:
    layouts = [s.split(",") for s in args.layouts]
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(_prepared_corpus(Path(tmp)))
        results = run_ranks(_measure, args.world, args=(args, layouts, data, tmp),
                            timeout_s=3600)[0]
    print(f"preset {args.preset} {' '.join(args.model)}, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch}, global batch {args.global_batch}, {args.world} ranks on cpu; "
          f"{args.steps} steps, alternately recorded and not")
    print("| layout | ms/step off | ms/step on | on/off | recorded calls/step × cost |")
    print("|---|---|---|---|---|")
    for res in results:
        off, on = statistics.median(res["off"]), statistics.median(res["on"])
        cost = res["calls"] * res["per_call"]
        print(f"| {res['layout']} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.3f} | "
              f"{res['calls']:.0f} × {res['per_call'] * 1e6:.2f} µs = "
              f"{100 * cost / off:.3f}% |")
