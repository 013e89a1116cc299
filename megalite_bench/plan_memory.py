"""The memory plan against real training steps: the peak live tensor bytes of each rank in its
`--steps`-th step (what is alive before it, `megalite_bench.memory.live_tensor_bytes`, + the
most the step's own allocations hold at once, `PeakBytes`: the CPU allocator's events replayed,
or CUDA's `max_memory_allocated`), next to the plan's peak for its stage and the plan's bytes
at every moment (`megalite.plan.memory`, `megalite.plan.peak_moments`).

    megalite-bench plan-memory data.dir=data/stdlib model.n_layer=8 train.micro_batch_size=8
    megalite-bench plan-memory --world-size 2 data.dir=data/stdlib pp=2      # gloo ranks

(Step 2, the default, is the first with every state alive through a whole step: AdamW makes
its moments in step 1's optimizer step.)
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Dict, List

from megalite.config.layout import Layout, validate
from megalite.config.schema import load_config
from megalite.plan.memory import make_plan
from megalite.plan.peak_moments import MOMENTS
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime, run_layout
from megalite_bench.memory import PeakBytes, live_storages, live_tensor_bytes


def _rank(rank: int, world: int, overrides: List[str], steps: int, run_dir: str
          ) -> Dict[str, object]:
    cfg = load_config(overrides)
    validate(cfg, world)
    runtime = init_runtime(cfg)
    before = live_storages(runtime.device) if runtime.device.type == "cpu" else None
    trainer = build_trainer(cfg, runtime, Path(run_dir) / f"rank{rank}")
    for _ in range(steps - 1):
        trainer.train_step()
    base = live_tensor_bytes(runtime.device, before)
    with PeakBytes(runtime.device) as peak:
        trainer.train_step()
    return {"peak": base + peak.bytes, "stage": trainer.topo.coords.pp_rank,
            "device_type": runtime.device.type}


def run(args) -> List[dict]:
    overrides = list(args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        if args.world_size == 1:
            results = [_rank(0, 1, overrides, args.steps, tmp)]
        else:
            results = run_ranks(_rank, args.world_size, args=(overrides, args.steps, tmp))
    cfg = load_config(overrides)
    device_type = results[0]["device_type"]
    layout = Layout.from_config(cfg, args.world_size, device_type) if args.world_size > 1 \
        else run_layout(cfg)
    plan = make_plan(cfg, layout)
    print(f"{' '.join(overrides)}: {args.world_size} rank(s), {device_type}, {args.steps} steps")
    print(f"{'rank':>4} {'stage':>5} {'measured B':>14} {'planned B':>14} {'ratio':>7}  peak at  "
          "(planned total at each moment: " + ", ".join(MOMENTS) + ")")
    rows = []
    for rank, res in enumerate(results):
        stage = plan.stages[res["stage"]]
        total = stage.bytes["total"]
        print(f"{rank:>4} {res['stage']:>5} {res['peak']:>14,} {total:>14,.0f} "
              f"{res['peak'] / total:>7.4f}  {stage.peak_at} ("
              + ", ".join(f"{stage.moments[m]['total']:,.0f}" for m in MOMENTS) + ")")
        rows.append({"rank": rank, **res, "planned": total, "peak_at": stage.peak_at,
                     "moments": stage.moments})
    worst = plan.peak
    print("terms at the peak (stage " + str(worst.stage) + "): " + ", ".join(
        f"{k} {v:,.0f}" for k, v in worst.bytes.items()))
    return rows


def add_arguments(parser) -> None:
    parser.add_argument("overrides", nargs="*", help="the run's configuration overrides")
    parser.add_argument("--world-size", type=int, default=1, help="gloo ranks (CPU) to spawn")
    parser.add_argument("--steps", type=int, default=2)
