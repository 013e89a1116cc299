"""What rerun attribution costs (`resilience.rerun`): training steps with it on against the same
steps without it, and the cost of a suspicious step, side by side in one run.

One trainer per layout (a gloo world of `--world` ranks, the real training path: pipeline
schedule, ZeRO engine, `Trainer.train_step` with the rerun's judgement) runs `--steps` steps
with the rerun on and off in turn (on, off, off, on, ...). Off takes the attribution away,
its gradient listener included. Every `--suspicious-every`-th step (with it on) is made
suspicious by hand (its spike test answers yes), so it runs the whole machinery that does
not stop the run: the re-execution, and with dp >= 2 the recomputation of the predecessor
replica's micro-batches, ending in a data verdict (the batch skipped), or with dp = 1 as
unresolved. Reported per layout from rank 0's clock: the median seconds per step off and on,
their ratio (the cost of a step that is not suspicious: the saved random streams and one pass
over the local gradient), and the median suspicious step relative to a step off (a transient
fault's step costs the first two executions of it before the run stops). `--control` runs
the 'on' steps without the rerun too: its on/off is the noise of the comparison.

The data: `--data` (a prepared directory), or the standard library corpus of
`megalite.bench.resilience` prepared into a temporary directory first.
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
            f"device={args.device}", f"train.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.global_batch}", "train.max_steps=1000000",
            "train.eval_every=0", "log.wandb=false", "log.progress=false",
            "log.peak_tflops=1", f"checkpoint.dir={run_dir}/ckpt",
            "resilience.check_every=0", "resilience.straggler_report_every=0",
            "resilience.rerun=on_nan", *layout]


def _timed_step(trainer) -> float:
    t0 = time.perf_counter()
    trainer.train_step()  # ends with a host read of the gradient norm
    trainer.rt.synchronize()
    return time.perf_counter() - t0


def _measure(rank: int, world: int, args, layouts: List[List[str]], data: str, root: str):
    from megalite.config import load_config
    from megalite.layout import validate
    from megalite.runtime import init_runtime
    from megalite.train.build import build_trainer

    results = []
    for i, layout in enumerate(layouts):
        cfg = load_config(_overrides(args, layout, data, f"{root}/{i}"))
        validate(cfg, world)
        trainer = build_trainer(cfg, init_runtime(cfg), Path(root) / str(i))
        rerun, listeners = trainer.rerun, trainer.engine.grad_launching
        tap = listeners[-1]
        judge = rerun.detector.suspicious
        steps = {"on": [], "off": [], "suspicious": []}
        for n in range(args.warmup + args.steps):
            suspicious = n % args.suspicious_every == args.suspicious_every - 1
            on = suspicious or n % 4 in (0, 3)
            trainer.rerun = rerun if on and not (args.control and not suspicious) else None
            if trainer.rerun is not None and tap not in listeners:
                listeners.append(tap)
            elif trainer.rerun is None and tap in listeners:
                listeners.remove(tap)
            rerun.detector.suspicious = (lambda values: ["made suspicious by the benchmark"]) \
                if suspicious else judge
            seconds = _timed_step(trainer)
            if n >= args.warmup:
                steps["suspicious" if suspicious else "on" if on else "off"].append(seconds)
        results.append({"layout": " ".join(layout), **steps,
                        "executions": 2 if trainer.topo.dp_size == 1 else 3})
    return results


def _row(res: dict) -> str:
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    sus = statistics.median(res["suspicious"])
    return (f"| {res['layout']} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.3f} | "
            f"{sus * 1e3:.2f} ({len(res['suspicious'])}) | {sus / off:.2f} | "
            f"{res['executions']} |")


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="tiny", help="model preset (conf/model)")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model overrides, e.g. n_layer=2")
    parser.add_argument("--layouts", nargs="+", default=["zero=0", "zero=1", "pp=2"],
                        help="comma-separated overrides per layout, each on --world ranks")
    parser.add_argument("--world", type=int, default=2, help="ranks (a gloo world)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per layout")
    parser.add_argument("--suspicious-every", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--control", action="store_true",
                        help="A/A: the 'on' steps without the rerun too (the noise of on/off)")
    parser.add_argument("--data", default=None, help="a prepared data directory")


def run(args) -> None:
    layouts = [s.split(",") for s in args.layouts]
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(_prepared_corpus(Path(tmp)))
        results = run_ranks(_measure, args.world, args=(args, layouts, data, tmp),
                            timeout_s=3600)[0]
    print(f"preset {args.preset} {' '.join(args.model)}, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch}, global batch {args.global_batch}, {args.world} ranks on "
          f"{args.device}; resilience.rerun=on_nan, every {args.suspicious_every}th step made "
          f"suspicious; {args.steps} steps" + (" (A/A control)" if args.control else ""))
    print("| layout | ms/step off | ms/step on | on/off | suspicious step ms (n) | "
          "suspicious/off | executions |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        print(_row(res))
