"""What the resilience checks cost: training steps with `resilience.check_every` and straggler
reports (`resilience.straggler_report_every`, which also times every wait in a collective)
against the same steps without them, side by side in one run.

One trainer per layout (a gloo world of `--world` ranks, the real training path of
`megalite.train`: pipeline schedule, ZeRO engine, then `Trainer.check_after_step`) runs blocks
of `--block` steps, alternately with the checks on and off (off, on, on, off, ...: noise hits
both alike). With `--block` equal to the intervals every block with the checks holds exactly
one replica check and one straggler report. Reported per layout: seconds per step off and on
(median over the blocks, of the slowest rank), their ratio, and the parts of the difference
measured directly: one replica check, one straggler report, and from them the overhead at
these intervals (check + report amortised over their interval) — on two shared cores the
block ratio moves by more than the 1% it is meant to show, the parts do not.

The data: `--data` (a prepared directory), or a small corpus of Python's standard library
prepared into a temporary directory first (150 files, a 1,024-token BPE).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import List

import torch

from megalite.spawn import run_ranks


def _prepared_corpus(root: Path) -> Path:
    from megalite.config import DataConfig
    from megalite.data.prepare import prepare

    out = root / "stdlib"
    prepare(DataConfig(dir=str(out), max_documents=150, tokenizer_vocab_size=1024,
                       val_fraction=0.05, num_proc=1), out, progress=False)
    return out


def _overrides(args, layout: List[str], data: str, run_dir: str) -> List[str]:
    return [f"model={args.preset}", *[f"model.{kv}" for kv in args.model], f"data.dir={data}",
            f"device={args.device}", f"train.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.global_batch}", "train.max_steps=1000000",
            "train.eval_every=0", "log.wandb=false", "log.progress=false",
            "log.peak_tflops=1", f"checkpoint.dir={run_dir}/ckpt",
            f"resilience.check_every={args.check_every}",
            f"resilience.straggler_report_every={args.report_every}", *layout]


class _Switch:
    """Turns a trainer's resilience checks (and the timing of collective waits) on and off."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.parts = (trainer.topo.counter.waits, trainer.replicas, trainer.stragglers)

    def set(self, on: bool) -> None:
        t = self.trainer
        waits, replicas, stragglers = self.parts if on else (None, None, None)
        t.topo.counter.waits = t.timers.waits = waits
        t.replicas, t.stragglers = replicas, stragglers
        t.timers.reset()
        if stragglers is not None:
            stragglers.start(t.step)


def _block(trainer, steps: int, checks: List[float]) -> float:
    """Seconds of `steps` training steps with their checks, of the slowest rank; the seconds
    of each step's checks that did something (a replica check, a report) go to `checks`."""
    from megalite.parallel import comm

    topo, device = trainer.topo, trainer.rt.device
    comm.barrier(topo.world_group)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
        c0 = time.perf_counter()
        checked = trainer.replicas is not None and trainer.replicas.due(trainer.step, False)
        if trainer.check_after_step(saving=False) is not None or checked:
            trainer.rt.synchronize()
            checks.append(time.perf_counter() - c0)
    trainer.rt.synchronize()
    seconds = time.perf_counter() - t0
    return comm.all_reduce_scalars([seconds], topo.world_group, device,
                                   op=torch.distributed.ReduceOp.MAX)[0]


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
        switch = _Switch(trainer)
        checks: List[float] = []
        per_step = {True: [], False: []}
        switch.set(False)
        _block(trainer, args.warmup, [])
        for b in range(2 * args.pairs):
            on = (b % 4) in (1, 2)  # off, on, on, off, ...
            switch.set(on)
            per_step[on].append(_block(trainer, args.block, checks) / args.block)
        results.append({"layout": " ".join(layout), "off": per_step[False],
                        "on": per_step[True], "checks": checks,
                        "passed": trainer.replicas.checks if trainer.replicas else 0})
    return results


def _row(res: dict, args) -> str:
    """ms per step off and on, their ratio, the checks' own time (median of the steps that
    ran one, and amortised over all the steps with the checks on, relative to a step)."""
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    checks = res["checks"]
    each = statistics.median(checks) if checks else 0.0
    amortised = sum(checks) / (args.pairs * args.block)
    return (f"| {res['layout']} | {off * 1e3:.1f} | {on * 1e3:.1f} | {on / off:.3f} | "
            f"{each * 1e3:.1f} ms ({len(checks)} steps) | {100 * amortised / off:.2f}% |")


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="tiny", help="model preset (conf/model)")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model overrides, e.g. n_layer=2")
    parser.add_argument("--layouts", nargs="+", default=["zero=0", "zero=1", "tp=2,sp=true",
                                                          "pp=2"],
                        help="comma-separated overrides per layout, each on --world ranks")
    parser.add_argument("--world", type=int, default=2, help="ranks (a gloo world)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--report-every", type=int, default=100)
    parser.add_argument("--block", type=int, default=100, help="steps per timed block")
    parser.add_argument("--pairs", type=int, default=2, help="blocks on (and off) per layout")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--data", default=None, help="a prepared data directory")


def run(args) -> None:
    layouts = [s.split(",") for s in args.layouts]
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(_prepared_corpus(Path(tmp)))
        results = run_ranks(_measure, args.world, args=(args, layouts, data, tmp),
                            timeout_s=3600)[0]
    print(f"preset {args.preset} {' '.join(args.model)}, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch}, global batch {args.global_batch}, {args.world} ranks on "
          f"{args.device}; check_every={args.check_every}, straggler_report_every="
          f"{args.report_every}; {args.pairs} blocks of {args.block} steps each way")
    print("| layout | ms/step off | ms/step on | on/off | a step's checks (median) | "
          "checks amortised / step |")
    print("|---|---|---|---|---|---|")
    for res in results:
        print(_row(res, args))
