"""Estimate, before launching, what every rank of a layout holds and sends: parameters,
gradients, optimizer state, activations in flight, the ZeRO-3 working set, and the bytes per
optimizer step over the TP, PP, DP and embedding groups (megalite/plan.py has the formulas).

    megalite-plan --world-size 16 model=gpt2-xl pp=2 zero=3 \\
        train.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=512
    megalite-plan --world-size 8 --gpu-memory-gib 80 model=gpt2-xl zero=1 ...

(`python scripts/plan.py ...` in a checkout is the same command.) Arguments after the options
are the same overrides megalite-pretrain takes; the configuration is validated as for a run.
Exit status 3 when a stage's estimate exceeds --gpu-memory-gib.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from megalite.calibrate import calibrate_command
from megalite.cli import config_for_world
from megalite.layout import Layout
from megalite.placement_fit import cheapest_fit
from megalite.plan import GIB, make_plan


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, help="ranks (GPUs) in all (not with --calibrate)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="for the check that a TP group fits in a node")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="decides the dtype where precision=auto (bf16 on cuda)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="flag stages whose estimate exceeds this much memory per device")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine instead (matmul rate at the model's shapes; under "
                        "torchrun, collective bandwidth) and save a device profile "
                        "(megalite/calibrate.py)")
    p.add_argument("--output", default="device-profile.json",
                   help="with --calibrate: the profile file to write")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model=gpt2 tp=2")
    return p


def main(argv: Optional[List[str]] = None) -> None:
    """`megalite-plan --world-size N [overrides]`; argv defaults to the command line."""
    cli = parser()
    args = cli.parse_args(argv)
    if args.calibrate:
        sys.exit(calibrate_command(args.overrides, args.output))
    if args.world_size is None:
        cli.error("the following arguments are required: --world-size")
    cfg = config_for_world(args.overrides, args.world_size, args.gpus_per_node, args.device)
    layout = Layout.from_config(cfg, args.world_size, args.device)
    plan = make_plan(cfg, layout)
    print(json.dumps(plan.as_dict(), indent=1) if args.json else plan.table())
    if args.gpu_memory_gib is not None:
        if args.gpu_memory_gib <= 0:
            cli.error(f"--gpu-memory-gib={args.gpu_memory_gib}: must be > 0 (e.g. 80)")
        over = [s for s in plan.stages if s.bytes["total"] > args.gpu_memory_gib * GIB]
        fit = cheapest_fit(cfg, layout, args.gpu_memory_gib * GIB) if over else None
        advice = f"the cheapest placement that fits: {fit.describe()}" if fit is not None \
            else "no placement change fits alone"
        for s in over:
            print(f"megalite: stage {s.stage} needs about {s.bytes['total'] / GIB:.1f} GiB per "
                  f"rank > {args.gpu_memory_gib:g} GiB; {advice}; or raise tp or pp, or lower "
                  "train.micro_batch_size", file=sys.stderr)
        if over:
            sys.exit(3)


if __name__ == "__main__":
    main()
