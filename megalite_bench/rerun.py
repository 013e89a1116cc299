"""What rerun attribution costs (`resilience.rerun`): training steps with it on against the same
steps without it, and the cost of a suspicious step, side by side in one run.

One trainer per layout (a gloo world of `--world` ranks, the real training path: pipeline
schedule, ZeRO engine, `Trainer.train_step` with the rerun's judgement) runs `--steps` steps
with the rerun on and off in turn (on, off, off, on, ...). Off takes the attribution away,
its gradient listener included. Every `--suspicious-every`-th step (with it on) is made
suspicious by the drill (`RerunAttribution.drill_next_step`), so it runs the whole machinery that does
not stop the run: the re-execution, and with dp >= 2 the recomputation of the predecessor
replica's micro-batches, ending in a data verdict (the batch skipped), or with dp = 1 as
unresolved. Reported per layout from rank 0's clock: the median seconds per step off and on,
their ratio (the cost of a step that is not suspicious: the saved random streams and one pass
over the local gradient), and the median suspicious step relative to a step off (a transient
fault's step costs the first two executions of it before the run stops). `--control` runs
the 'on' steps without the rerun too: its on/off is the noise of the comparison.

The harness and the data: `megalite_bench.on_off`.
"""
from __future__ import annotations

import statistics
import time

from megalite_bench.on_off import CHECKS_OFF, describe, is_on, run_layouts
from megalite_bench.on_off import add_arguments as add_common_arguments


def _timed_step(trainer) -> float:
    t0 = time.perf_counter()
    trainer.train_step()  # ends with a host read of the gradient norm
    trainer.rt.synchronize()
    return time.perf_counter() - t0


def _measure(trainer, args, rank: int) -> dict:
    rerun = trainer.rerun
    steps = {"on": [], "off": [], "suspicious": []}
    for n in range(args.warmup + args.steps):
        suspicious = n % args.suspicious_every == args.suspicious_every - 1
        on = suspicious or is_on(n)
        trainer.use_rerun(rerun if on and not (args.control and not suspicious) else None)
        if suspicious:
            rerun.drill_next_step("made suspicious by the benchmark")
        seconds = _timed_step(trainer)
        if n >= args.warmup:
            steps["suspicious" if suspicious else "on" if on else "off"].append(seconds)
    return {**steps, "executions": 2 if trainer.topo.dp_size == 1 else 3}


def _row(res: dict) -> str:
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    sus = statistics.median(res["suspicious"])
    return (f"| {res['layout']} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.3f} | "
            f"{sus * 1e3:.2f} ({len(res['suspicious'])}) | {sus / off:.2f} | "
            f"{res['executions']} |")


def add_arguments(parser) -> None:
    add_common_arguments(parser, layouts=["zero=0", "zero=1", "pp=2"], seq_len=128, steps=200)
    parser.add_argument("--suspicious-every", type=int, default=10)
    parser.add_argument("--control", action="store_true",
                        help="A/A: the 'on' steps without the rerun too (the noise of on/off)")


def run(args) -> None:
    results = run_layouts(args, [*CHECKS_OFF, "resilience.rerun=on_nan"], _measure)
    print(f"{describe(args)}; resilience.rerun=on_nan, every {args.suspicious_every}th step "
          f"made suspicious; {args.steps} steps" + (" (A/A control)" if args.control else ""))
    print("| layout | ms/step off | ms/step on | on/off | suspicious step ms (n) | "
          "suspicious/off | executions |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        print(_row(res))
