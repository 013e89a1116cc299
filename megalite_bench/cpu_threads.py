"""CPU threads: the quickstart's training step (the tiny preset, micro-batch 8, global batch 32,
sequence 128, one process on the CPU) with megalite's choice of intra-op threads (`cpu_threads`
unset: `megalite.train.host_threads.cpu_thread_choice`) against torch's default (every core:
`cpu_threads=<cores>`), side by side: each arm a fresh process, the arms alternated (megalite,
torch, torch, megalite, ...) so that the drift of a shared machine hits both alike; on the
machine as it is and again with `--load` busy processes added (a load generator).

    megalite-bench cpu-threads --steps 4 --repeats 2 --load 0 4
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

QUICKSTART = ["model=tiny", "device=cpu", "train.micro_batch_size=8",
              "train.global_batch_size=32", "train.seq_len=128", "train.eval_every=0",
              "log.wandb=false", "log.progress=false", "train.max_steps=1000000"]


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each arm per load (alternated)")
    parser.add_argument("--load", type=int, nargs="+", default=[0, 4],
                        help="busy processes added while measuring, one table row each")
    parser.add_argument("--data", default=None, help="a prepared data directory (default: "
                        "300 documents of Python's standard library, prepared first)")


def worker(data: str, run_dir: str, steps: int, warmup: int, threads: Optional[int]) -> dict:
    """In a fresh process: one trainer of the quickstart's shape, `warmup` + `steps` steps;
    the seconds per timed step and the threads torch ran with."""
    import torch

    from megalite.config.schema import load_config
    from megalite.train.launch import launch

    extra = [] if threads is None else [f"cpu_threads={threads}"]
    cfg = load_config(QUICKSTART + [f"data.dir={data}", f"checkpoint.dir={run_dir}/ckpt",
                                    *extra])
    trainer = launch(cfg, 1, Path(run_dir)).trainer
    for _ in range(warmup):
        trainer.train_step()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return {"s_per_step": (time.perf_counter() - start) / steps,
            "threads": torch.get_num_threads()}


def _busy() -> None:
    while True:
        pass


def one_run(data: str, root: str, args, threads: Optional[int]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    spec = json.dumps([data, root, args.steps, args.warmup, threads])
    out = subprocess.run([sys.executable, "-m", "megalite_bench.cpu_threads", spec],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(data: str, args, load: int, cores: int) -> dict:
    """Both arms' mean seconds a step at `load` added busy processes, and the load average
    seen (the machine's own plus the generator's)."""
    busy = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(load)]
    for p in busy:
        p.start()
    try:
        time.sleep(5 if load else 0)
        arms = {"megalite": [], "torch": []}
        threads = {}
        seen = []
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                order = ("megalite", "torch") if r % 2 == 0 else ("torch", "megalite")
                for arm in order:
                    seen.append(os.getloadavg()[0])
                    res = one_run(data, f"{tmp}/{r}{arm}", args,
                                  None if arm == "megalite" else cores)
                    arms[arm].append(res["s_per_step"])
                    threads[arm] = res["threads"]
    finally:
        for p in busy:
            p.terminate()
    mean = {arm: sum(v) / len(v) for arm, v in arms.items()}
    return {"added": load, "load": sum(seen) / len(seen), "threads": threads, "s": mean,
            "speedup": mean["torch"] / mean["megalite"]}


def run(args) -> None:
    from megalite.train.host_threads import cores_available

    cores = cores_available()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            from megalite.config.schema import DataConfig
            from megalite.data.prepare import prepare

            data = str(Path(tmp) / "stdlib")
            prepare(DataConfig(dir=data, max_documents=300, val_fraction=0.05, num_proc=1),
                    Path(data), progress=False)
        rows = [measure(data, args, load, cores) for load in args.load]
    print(f"quickstart step (tiny, micro-batch 8, global batch 32, seq 128), {cores} cores, "
          f"{args.steps} timed steps x {args.repeats} runs per arm")
    print(f"{'added load':>10} {'load avg':>8} {'megalite thr':>12} {'s/step':>7} "
          f"{'torch thr':>9} {'s/step':>7} {'torch/megalite':>14}")
    for r in rows:
        print(f"{r['added']:>10} {r['load']:>8.1f} {r['threads']['megalite']:>12} "
              f"{r['s']['megalite']:>7.2f} {r['threads']['torch']:>9} {r['s']['torch']:>7.2f} "
              f"{r['speedup']:>14.2f}")


if __name__ == "__main__":  # a worker: its spec as JSON, one JSON line out
    data_, root_, steps_, warmup_, threads_ = json.loads(sys.argv[1])
    result = worker(data_, root_, steps_, warmup_, threads_)
    print(json.dumps(result))
