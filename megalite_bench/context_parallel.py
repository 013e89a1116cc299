"""Context parallelism on a long sequence: per cp in `--cp` (default 1 2 4) one gloo world of
cp ranks (tp = pp = dp = 1), a trainer per `parallel.cp_comm` (allgather and ring, built in
turn in the same world) launched as `megalite-pretrain` launches it
(`megalite.train.launch.launch`), and for each:

  peak bytes per rank   measured in the trainer's step `--warmup` + 1 (the first with AdamW's
                        moments alive through a whole step): the live tensor bytes at the
                        step's start (`megalite_bench.memory.live_tensor_bytes`, less what the
                        world held before this trainer was built) + the most the step's own
                        allocations hold at once (`PeakBytes`: the CPU allocator's events
                        recorded by torch.profiler and replayed), the slowest rank's; next to
                        the launch's own plan for that rank (`Run.plan`,
                        `megalite.plan.memory`: activations / cp and CP attention's buffers).
                        Tensor bytes, the quantity the plan predicts: a process's RSS would add
                        the Python heap, torch's and gloo's buffers and the allocator's free
                        lists (hundreds of MB that do not scale with cp), and ru_maxrss only
                        rises, so it could not tell two trainers of one process apart.
  tokens/s              global tokens per optimizer step over the median step time (each step
                        from a barrier, the slowest rank's); the comms' timed steps alternate
                        (allgather, ring, ring, allgather, ...) so that a shared machine's
                        drift hits both alike. Only ratios inside one world mean anything
                        here: cp ranks share this machine's cores.

Then, in the same world, attention alone (`megalite_bench.context_parallel_kernels`):
megalite's `cp_attention` (allgather, ring) against torch's own context parallel
(`torch.distributed.tensor.experimental.context_parallel` around SDPA) where it runs, its
error where it does not.

    megalite-bench cp                                   # llama-tiny at 8,192 tokens, cp 1 2 4
    megalite-bench cp --seq-len 256 --cp 1 2 --steps 1  # a smoke run (about a minute)

The data: `--data` (a prepared directory), or a small corpus prepared into a temporary
directory first (`megalite_bench.on_off.prepared_corpus`).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from megalite.testing.spawn import run_ranks
from megalite_bench.on_off import CHECKS_OFF, prepared_corpus

COMMS = ("allgather", "ring")


def trainer_overrides(args, cp: int, comm: str, data: str, run_dir: str) -> List[str]:
    """A benchmark trainer at `cp`: no evaluation, no logging services, no checks."""
    return [f"model={args.preset}", f"model.n_positions={args.seq_len}",
            *[f"model.{kv}" for kv in args.model], f"data.dir={data}",
            f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.micro_batch}", "train.max_steps=1000000",
            "train.eval_every=0", "log.wandb=false", "log.progress=false", "log.peak_tflops=1",
            f"checkpoint.dir={run_dir}/ckpt", *CHECKS_OFF, f"cp={cp}",
            f"parallel.cp_comm={comm}"]


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _build_and_measure(args, cp: int, comm: str, data: str, root: str) -> dict:
    """A trainer launched at `cp`/`comm`, its warmup steps and the measured step's peak."""
    from megalite.config.schema import load_config
    from megalite.train.launch import launch
    from megalite_bench.memory import PeakBytes, live_storages, live_tensor_bytes

    run_dir = f"{root}/cp{cp}-{comm}"
    before = live_storages()  # the world's and any earlier trainer's tensors
    run = launch(load_config(trainer_overrides(args, cp, comm, data, run_dir)), cp, run_dir)
    trainer = run.trainer
    for _ in range(args.warmup):
        trainer.train_step()
    base = live_tensor_bytes(torch.device("cpu"), before)
    with PeakBytes() as peak:
        trainer.train_step()
    measured = torch.tensor([float(base + peak.bytes)], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    planned = run.plan.stages[trainer.topo.coords.pp_rank].bytes["total"]
    return {"trainer": trainer, "measured": measured.item(), "planned": planned,
            "tokens": trainer.last_batch_size * args.seq_len}


def _timed_steps(trainers: Dict[str, object], steps: int) -> Dict[str, float]:
    """Median seconds per step of each trainer, steps alternated A B B A ... from barriers."""
    names = list(trainers)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for i in range(steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            trainers[name].train_step()
            times[name].append(_slowest(time.perf_counter() - t0))
    return {n: statistics.median(v) for n, v in times.items()}


def _world(rank: int, world: int, args, data: str, root: str) -> dict:
    from megalite_bench.context_parallel_kernels import compare_attention

    comms = COMMS if world > 1 else COMMS[:1]  # at cp 1 the comms are the same run
    built = {comm: _build_and_measure(args, world, comm, data, root) for comm in comms}
    seconds = _timed_steps({c: b["trainer"] for c, b in built.items()}, args.steps)
    rows = [{"cp": world, "comm": c if world > 1 else "-", "measured": b["measured"],
             "planned": b["planned"], "tokens_per_s": b["tokens"] / seconds[c]}
            for c, b in built.items()]
    trainer = built[comms[0]]["trainer"]
    kernels = compare_attention(trainer.cfg, trainer.topo, args.steps) if world > 1 else []
    return {"rows": rows, "kernels": kernels}


def run(args) -> Dict[str, List[dict]]:
    """{"memory": a row per (cp, cp_comm), "attention": a row per contender and cp > 1}."""
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(prepared_corpus(Path(tmp)))
        worlds = [run_ranks(_world, cp, args=(args, data, tmp), timeout_s=3600)[0]
                  for cp in args.cp]
    rows = [r for w in worlds for r in w["rows"]]
    _print_memory(args, rows)
    for w in worlds:
        _print_kernels(w["kernels"])
    return {"memory": rows, "attention": [k for w in worlds for k in w["kernels"]]}


def _print_memory(args, rows: List[dict]) -> None:
    base = rows[0]
    print(f"\n{' '.join([args.preset, *args.model])}, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch}, fp32, gloo ranks (tp = pp = dp = 1, world = cp), "
          f"{args.steps} timed steps after {args.warmup} warmup + 1 measured")
    print(f"{'cp':>3} {'cp_comm':>9} {'peak MiB':>9} {'plan MiB':>9} {'meas/plan':>9} "
          f"{'peak/cp1':>9} {'plan/cp1':>9} {'tokens/s':>9} {'ring/allgather':>15}")
    by = {(r["cp"], r["comm"]): r for r in rows}
    for r in rows:
        ag = by.get((r["cp"], "allgather"))
        versus = f"{r['tokens_per_s'] / ag['tokens_per_s']:.3f}" \
            if r["comm"] == "ring" and ag else ""
        print(f"{r['cp']:>3} {r['comm']:>9} {r['measured'] / 2**20:>9.1f} "
              f"{r['planned'] / 2**20:>9.1f} {r['measured'] / r['planned']:>9.4f} "
              f"{r['measured'] / base['measured']:>9.3f} {r['planned'] / base['planned']:>9.3f} "
              f"{r['tokens_per_s']:>9.0f} {versus:>15}")
    for comm in COMMS:
        peaks = [r["measured"] for r in rows if r["comm"] in (comm, "-")]
        falls = all(a > b for a, b in zip(peaks, peaks[1:]))
        print(f"measured peak per rank falls with cp ({comm}): {'yes' if falls else 'NO'}")


def _print_kernels(kernels: List[dict]) -> None:
    if not kernels:
        return
    ref = next(k for k in kernels if k["name"] == "megalite allgather")
    print(f"\nattention alone, fwd + bwd, cp {kernels[0]['cp']} ({kernels[0]['shape']}):")
    for k in kernels:
        if k["seconds"] is None:
            print(f"  {k['name']:<32} did not run: {k['error']}")
        else:
            print(f"  {k['name']:<32} {k['seconds'] * 1e3:>9.1f} ms   "
                  f"{k['seconds'] / ref['seconds']:.3f}x allgather's time")


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="llama-tiny", help="model preset (conf/model)")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model overrides, e.g. n_embd=256")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4],
                        help="cp sizes, each a gloo world of that many ranks (1 first)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per trainer")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--data", default=None, help="a prepared data directory")
