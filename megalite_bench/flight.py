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
import time

from megalite.resilience.flight import FlightRecorder
from megalite_bench.on_off import CHECKS_OFF, describe, is_on, run_layouts
from megalite_bench.on_off import add_arguments as add_common_arguments


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


def _measure(trainer, args, rank: int) -> dict:
    counters = [trainer.topo.counter, trainer.topo.checkpoint_group.counter]
    recorder = counters[0].flight
    steps = {True: [], False: []}
    calls = []
    for n in range(args.warmup + args.steps):
        on = is_on(n)
        for c in counters:
            c.flight = recorder if on else None
        before = _recorded(recorder)
        t0 = time.perf_counter()
        trainer.train_step()  # ends with a host read of the gradient norm
        if n >= args.warmup:
            steps[on].append(time.perf_counter() - t0)
        if on:
            calls.append(_recorded(recorder) - before)
    per_call = _seconds_per_record(FlightRecorder(rank, trainer.cfg.resilience.hang_history),
                                   trainer.topo.world_group)
    return {"off": steps[False], "on": steps[True], "calls": statistics.median(calls),
            "per_call": per_call}


def add_arguments(parser) -> None:
    add_common_arguments(parser, layouts=["zero=1", "tp=2,sp=true", "pp=2"], seq_len=64,
                         steps=200, device=False)


def run(args) -> None:
    results = run_layouts(args, [*CHECKS_OFF, "resilience.hang_dump=true"], _measure)
    print(f"{describe(args)}; {args.steps} steps, alternately recorded and not")
    print("| layout | ms/step off | ms/step on | on/off | recorded calls/step × cost |")
    print("|---|---|---|---|---|")
    for res in results:
        off, on = statistics.median(res["off"]), statistics.median(res["on"])
        cost = res["calls"] * res["per_call"]
        print(f"| {res['layout']} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.3f} | "
              f"{res['calls']:.0f} × {res['per_call'] * 1e6:.2f} µs = "
              f"{100 * cost / off:.3f}% |")
