"""The launch path's pipeline against torch's: a trainer built as `megalite-pretrain` builds it
(`build_trainer`, its defaults on: flight recorder, per-operation wait timing, hang watch,
replica checks and straggler reports at their intervals), trained through `Trainer.fit`, side
by side in one run with `torch.distributed.pipelining.Schedule1F1B` over the same chunks (a
second copy of this rank's stage, the same initial weights) on the same micro-batches (the
trainer's loader's, step by step), then the same tied-embedding sum, global-norm clipping and
`torch.optim.AdamW` (megalite_bench/pipeline.py's contender). gloo ranks, tp = dp = 1, world =
pp.

Each step of `fit` runs both: megalite's step (its `train_step` and the rest of `fit`'s loop
around it: metrics lines every `log.every` steps, the checks when due, the stop request) and
torch's, in alternating order (A B B A ...), each started from a barrier; a step's time is the
slowest rank's. `--repeats R` runs the whole comparison R times, each in a fresh world, and
reports each run's ratio (median torch step / median megalite step: > 1, megalite faster),
its paired ratio (the median over steps of torch's step / megalite's step of the same step
of fit: the two ran within a second of each other, under the same load), and their medians.

`--costs` measures, on the same 2 ranks, what each watching feature costs per operation on
the pipeline's point-to-point path: a ping-pong of one-batch rounds (a send and a receive of
an activation-sized tensor, posted as the schedule posts a round, waited for at once) with
the defaults' instruments (the flight recorder, the wait timing, both) against none, A B B A,
the difference per batch. Before it, each feature's own work per operation in this process
(`instrument_costs`: the recorder's calls for a collective and for a pipeline batch, the wait
timing's wrapper, and the hang watch's look at full rings, `FlightRecorder.poll`, which the
watch makes every min(2, hang_wait_s / 4) s in its own thread).

    python scripts/bench.py pipeline-launch --steps 40 --repeats 5
    python scripts/bench.py pipeline-launch --costs
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import List

import torch
import torch.distributed as dist

from megalite.testing.spawn import run_ranks
from megalite_bench.on_off import prepared_corpus
from megalite_bench.pipeline import torch_pipeline_step

# what differs from pretrain's defaults: no wandb / progress bar (a benchmark's output), no
# evaluation (not a training step; fit excludes it from throughput too)
BENCH_OVERRIDES = ["log.wandb=false", "log.progress=false", "train.eval_every=0"]


def _launch_path(rank: int, world: int, data: str, root: str, overrides: List[str],
                 warmup: int, steps: int) -> dict:
    from megalite.config.schema import load_config
    from megalite.train.launch import launch

    cfg = load_config([f"pp={world}", f"data.dir={data}", *BENCH_OVERRIDES,
                       f"train.max_steps={warmup + steps}", *overrides])
    trainer = launch(cfg, world, Path(root)).trainer
    topo = trainer.topo
    m = trainer.layout.micro_batches(cfg.train.global_batch_size)
    torch_step = torch_pipeline_step(cfg.model, topo,
                                     trainer.layout.stage_blocks()[topo.coords.pp_rank], m)
    times = {"megalite": [], "torch": []}
    losses = {"megalite": [], "torch": []}
    state = {"n": 0, "exit": None}
    rest: List[float] = []  # fit's loop around train_step (metrics lines, checks, ...)

    def both(train_step):
        """fit's step: megalite's and torch's, in the order of step n (A B B A ...); torch's
        on the micro-batches megalite's loader read last (this step's, or the previous one's
        where torch goes first)."""
        n, now = state["n"], time.perf_counter()
        if state["exit"] is not None:  # the rest of fit's loop after the previous step
            times["megalite"][-1] += now - state["exit"]
            rest.append(now - state["exit"])
        order = ("megalite", "torch") if n % 4 in (0, 3) else ("torch", "megalite")
        result = None
        for contender in order:
            dist.barrier()
            t0 = time.perf_counter()
            if contender == "megalite":
                result = train_step()
                losses["megalite"].append(result[0] or 0.0)
            else:
                losses["torch"].append(torch_step(trainer.last_micro_batches)[0])
            times[contender].append(time.perf_counter() - t0)
        state["n"], state["exit"] = n + 1, time.perf_counter()
        return result

    trainer.fit(around_step=both)
    times["megalite"][-1] += time.perf_counter() - state["exit"]  # (the last step's save)
    out = {"fit_loop_s": statistics.median(rest[warmup:])}
    for name in times:  # the slowest rank's, step by step
        t = torch.tensor(times[name][warmup:-1], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = t.tolist()
        loss = torch.tensor(losses[name][:1], dtype=torch.float64)
        dist.all_reduce(loss)  # from the last stage
        out[f"{name}_loss"] = loss.item()
    return out


def _run_once(args, data: str, root: str) -> dict:
    res = run_ranks(_launch_path, args.world, args=(data, root, args.overrides, args.warmup,
                                                    args.steps), timeout_s=3600)[0]
    mega, ref = statistics.median(res["megalite"]), statistics.median(res["torch"])
    paired = statistics.median(t / m for t, m in zip(res["torch"], res["megalite"]))
    return {"megalite_s": mega, "torch_s": ref, "ratio": ref / mega, "paired": paired,
            "fit_loop_s": res["fit_loop_s"],
            "loss_rel_diff": abs(res["megalite_loss"] - res["torch_loss"])
            / abs(res["torch_loss"])}


# --- per-operation costs ------------------------------------------------------------------


def _ping_pong(rank: int, world: int, numel: int, batches: int, warmup: int) -> dict:
    from megalite.parallel import comm
    from megalite.parallel.group import CollectiveWaits
    from megalite.parallel.topology import build_topology
    from megalite.resilience.flight import FlightRecorder
    from megalite.utils.clock import DeviceClock

    topo = build_topology(1, world, 1)
    group, counter = topo.pp_group, topo.counter
    peer = 1 - group.rank
    send, recv = torch.ones(numel), torch.empty(numel)
    recorder = FlightRecorder(rank, 32)
    waits = CollectiveWaits(DeviceClock(torch.device("cpu")))
    arms = {"none": (None, None), "flight": (recorder, None), "waits": (None, waits),
            "both": (recorder, waits)}
    per_batch = {name: [] for name in arms}
    for block in range(warmup + 8):
        names = list(arms) if block % 2 == 0 else list(arms)[::-1]
        for name in names:
            counter.flight, counter.waits = arms[name]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(batches):
                comm.send_recv([(send, peer)], [(recv, peer)], group, async_op=True).wait()
            if block >= warmup:
                per_batch[name].append((time.perf_counter() - t0) / batches)
    counter.flight = counter.waits = None
    return {"per_batch": {k: statistics.median(v) for k, v in per_batch.items()}}


def _per_call(fn, calls: int = 50000) -> float:
    """Seconds per call of `fn`, less an empty loop's."""
    t0 = time.perf_counter()
    for _ in range(calls):
        pass
    bare = time.perf_counter() - t0
    best = float("inf")
    for _ in range(5):  # the best of 5: the machine's noise only adds
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0 - bare)
    return best / calls


def instrument_costs(calls: int = 50000) -> dict:
    """Each watching feature's own work per operation, in this process (no communication):
    what the wrapper adds to a call on CPU; seconds, the best of 5 x `calls` calls (a look:
    `calls` / 25)."""
    from megalite.parallel.group import CollectiveWaits, Group, single_rank_group
    from megalite.resilience.flight import FlightRecorder
    from megalite.utils.clock import DeviceClock

    group = Group(name="pp", ranks=[0, 1], rank=0, pg=None,
                  counter=single_rank_group("pp").counter)
    rec = FlightRecorder(0, 32, hang_after_s=480.0)
    waits = CollectiveWaits(DeviceClock(torch.device("cpu")))

    def collective():  # a blocking collective: launched, waited for, done at its return
        entry = rec.started("all_reduce", group, 1024)
        rec.waiting(entry)
        rec.done(entry)

    def batch():  # a pipeline batch: posted (no probe on gloo), waited for, done
        entry = rec.started("send/recv", group, 1024, peers=[1])
        rec.waiting(entry)
        rec.done(entry)

    def noop():
        return None

    timed = _per_call(lambda: waits.timed(noop), calls) - _per_call(noop, calls)
    for g in range(6):  # a look at full rings of a pp 2 rank's groups
        grp = Group(name=f"g{g}", ranks=[0, 1], rank=0, pg=None, counter=group.counter)
        for _ in range(32):
            rec.done(rec.started("all_reduce", grp, 8))
    return {"flight_collective": _per_call(collective, calls),
            "flight_batch": _per_call(batch, calls), "wait_timing": timed,
            "look": _per_call(lambda: rec.poll(time.time()), max(1, calls // 25))}


def _costs(args) -> None:
    costs = instrument_costs()
    print("each feature's own work per operation, in this process (best of 5 x 50,000 calls)")
    print("| feature | per operation |")
    print("|---|---|")
    print(f"| flight recorder, a collective (launched, waited for, done) | "
          f"{costs['flight_collective'] * 1e6:.2f} µs |")
    print(f"| flight recorder, a pipeline batch (posted, waited for, done) | "
          f"{costs['flight_batch'] * 1e6:.2f} µs |")
    print(f"| wait timing (CPU: two perf_counter reads) | {costs['wait_timing'] * 1e6:.2f} µs |")
    print(f"| hang watch: one look at 6 full rings (in its own thread, every 2 s) | "
          f"{costs['look'] * 1e6:.1f} µs |")
    numel = args.activation_numel
    res = run_ranks(_ping_pong, 2, args=(numel, args.batches, 2), timeout_s=3600)[0]
    base = res["per_batch"]["none"]
    print(f"point-to-point rounds of one send + one receive of {numel} fp32 ({numel * 4} "
          f"bytes), 2 gloo ranks, {args.batches} rounds x 8 blocks per arm, A B B A; median "
          "seconds per round")
    print("| instruments | µs per round | over none |")
    print("|---|---|---|")
    for name, sec in res["per_batch"].items():
        print(f"| {name} | {sec * 1e6:.1f} | {(sec - base) * 1e6:+.2f} µs |")


def run(args) -> None:
    if args.costs:
        _costs(args)
        return
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(prepared_corpus(Path(tmp)))
        print(f"torch {torch.__version__}, gloo, {args.world} ranks (pp={args.world}), "
              f"pretrain's defaults + {' '.join(BENCH_OVERRIDES + args.overrides)}; "
              f"{args.warmup} warmup + {args.steps} timed steps a run, {args.repeats} runs",
              flush=True)
        print("| run | megalite s/step | torch s/step | torch / megalite | paired | loss rel "
              "diff, step 1 | fit's loop around a step (rank 0, median) |")
        print("|---|---|---|---|---|---|---|")
        for i in range(args.repeats):
            row = _run_once(args, data, f"{tmp}/run{i}")
            ratios.append((row["ratio"], row["paired"]))
            print(f"| {i + 1} | {row['megalite_s']:.4f} | {row['torch_s']:.4f} | "
                  f"{row['ratio']:.3f} | {row['paired']:.3f} | {row['loss_rel_diff']:.1e} | "
                  f"{row['fit_loop_s'] * 1e3:.2f} ms |", flush=True)
    print(f"median over {len(ratios)} runs: torch / megalite "
          f"{statistics.median(r for r, _ in ratios):.3f}, paired "
          f"{statistics.median(p for _, p in ratios):.3f}")


def add_arguments(parser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks = pipeline stages")
    parser.add_argument("--steps", type=int, default=40, help="timed steps a run")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs, each in a fresh world")
    parser.add_argument("--data", default=None, help="a prepared data directory (default: "
                        "150 files of Python's standard library prepared into a temporary one)")
    parser.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="configuration overrides after the defaults")
    parser.add_argument("--costs", action="store_true",
                        help="the per-operation costs of the watching features instead")
    parser.add_argument("--activation-numel", type=int, default=128 * 8 * 128,
                        help="--costs: elements a transfer carries (tiny's seq x micro-batch "
                             "x width)")
    parser.add_argument("--batches", type=int, default=200, help="--costs: rounds per block")
