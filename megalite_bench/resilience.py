"""What the resilience checks cost: training steps with `resilience.check_every` and straggler
reports (`resilience.straggler_report_every`, which also times every wait in a collective)
against the same steps without them, side by side in one run.

One trainer per layout (a gloo world of `--world` ranks, the real training path of
`megalite.train`: pipeline schedule, ZeRO engine, then `Trainer.check_after_step`) runs
`--steps` steps with the checks on and off in turn (on, off, off, on, ...: drift of a shared
machine hits both alike; with intervals that are multiples of 4, every check and report falls
on a step with them on). Reported per layout, from rank 0's clock: the median seconds per
step off and on (a step that ran the replica check or the straggler report counted without
them), their ratio (the per-step cost: timing the waits in collectives), the median time of
one check + report and that time amortised over its interval, relative to a step; the cost
of timing the waits computed exactly (collective calls per step × the measured cost of
timing one call around an empty one); and the overhead, ratio and amortised checks together.
`--control` runs both arms without the checks: its on/off is the noise of the comparison.
Every step ends with the host reading the gradient norm, so a step's time on CUDA is the
device's.

The harness (the alternation, the trainers, the data): `megalite_bench.on_off`.
"""
from __future__ import annotations

import statistics
import time
from typing import List

from megalite_bench.on_off import add_arguments as add_common_arguments
from megalite_bench.on_off import describe, is_on, run_layouts


class _Switch:
    """Turns a trainer's resilience checks (and the timing of collective waits) on and off
    between two steps."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.parts = (trainer.topo.counter.waits, trainer.replicas, trainer.stragglers)

    def set(self, on: bool) -> None:
        t = self.trainer
        waits, replicas, stragglers = self.parts if on else (None, None, None)
        t.topo.counter.waits = t.timers.waits = waits
        t.replicas, t.stragglers = replicas, stragglers


def _timed_step(trainer) -> tuple:
    """(seconds of one training step, seconds of the checks after it, collective calls
    timed in the step) on this rank."""
    waits = trainer.topo.counter.waits
    before = 0 if waits is None else waits.calls
    t0 = time.perf_counter()
    trainer.train_step()  # ends with a host read of the gradient norm
    t1 = time.perf_counter()
    calls = 0 if waits is None else waits.calls - before
    trainer.check_after_step(saving=False)
    trainer.rt.synchronize()
    return t1 - t0, time.perf_counter() - t1, calls


def _seconds_per_timed_call(waits, calls: int = 20000) -> float:
    """What timing one collective call adds (two marks and the bookkeeping), measured
    around an empty call."""
    def nothing():
        return None

    t0 = time.perf_counter()
    for _ in range(calls):
        nothing()
    bare = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(calls):
        waits.timed(nothing)
    timed = time.perf_counter() - t0
    waits.clear()
    return (timed - bare) / calls


def _measure(trainer, args, rank: int) -> dict:
    switch = _Switch(trainer)
    trainer.timers.reset()
    if trainer.stragglers is not None:
        trainer.stragglers.start(trainer.step)
    steps = {True: [], False: []}
    checks: List[float] = []  # the checks of the steps that ran one (a check, a report)
    calls: List[int] = []  # collective calls timed per step
    for n in range(args.warmup + args.steps):
        on = is_on(n) and not args.control
        switch.set(on)
        step_s, check_s, timed_calls = _timed_step(trainer)
        calls.append(timed_calls) if on else None
        if n < args.warmup:
            continue
        due = on and (trainer.step % args.check_every == 0
                      or trainer.step % args.report_every == 0)
        if due:  # timed on its own: it runs once per interval
            checks.append(check_s)
            steps[on].append(step_s)
        else:
            steps[on].append(step_s + check_s)
    if args.control:  # A/A: the second arm's steps were off too
        steps[True], steps[False] = steps[False][0::2], steps[False][1::2]
    waits = switch.parts[0]
    per_call = _seconds_per_timed_call(waits) if waits is not None else 0.0
    return {"off": steps[False], "on": steps[True], "checks": checks,
            "calls": statistics.median(calls) if calls else 0, "per_call": per_call}


def _row(res: dict, args) -> str:
    """ms per step off and on (median; the steps that ran a check or report left out), their
    ratio, a check's time (median) and the checks amortised over their interval."""
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    checks = res["checks"]
    each = statistics.median(checks) if checks else 0.0
    interval = min(args.check_every, args.report_every)
    amortised = each / interval
    total = on / off - 1 + amortised / off
    timing = res["calls"] * res["per_call"]
    return (f"| {res['layout']} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.3f} | "
            f"{each * 1e3:.1f} ms ({len(checks)}) | {100 * amortised / off:.2f}% | "
            f"{res['calls']:.0f} × {res['per_call'] * 1e6:.2f} µs = "
            f"{100 * timing / off:.3f}% | {100 * total:+.2f}% |")


def add_arguments(parser) -> None:
    add_common_arguments(parser, layouts=["zero=0", "zero=1", "tp=2,sp=true", "pp=2"],
                         seq_len=128, steps=400)
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--report-every", type=int, default=100)
    parser.add_argument("--control", action="store_true",
                        help="A/A: both arms without the checks (the noise of on/off)")


def run(args) -> None:
    results = run_layouts(args, [f"resilience.check_every={args.check_every}",
                                 f"resilience.straggler_report_every={args.report_every}"],
                          _measure)
    print(f"{describe(args)}; check_every={args.check_every}, straggler_report_every="
          f"{args.report_every}; {args.steps} steps, alternately on and off")
    print("| layout | ms/step off | ms/step on | on/off | a check + report (steps) | "
          "amortised | wait timing: calls × cost | overhead (on/off + amortised) |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        print(_row(res, args))
