"""Estimate, before launching, what every rank of a layout holds and sends: parameters,
gradients, optimizer state, activations in flight, the ZeRO-3 working set, and the bytes per
optimizer step over the TP, CP, PP, DP and embedding groups (megalite/plan/memory.py has the formulas);
with a device profile also the predicted step time, tokens/s, TFLOP/s and MFU
(megalite/plan/time_model.py); with --search the fastest layouts that fit.

    megalite-plan --world-size 16 model=gpt2-xl pp=2 zero=3 \\
        train.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=512
    megalite-plan --world-size 64 --device h100-80gb model=gpt2-xl ...
    megalite-plan --search --world-size 64 --gpus-per-node 8 --device h100-80gb \\
        model=gpt2-xl train.global_batch_size=512 train.seq_len=1024 [--plot search.png]
    torchrun --nproc_per_node=2 scripts/plan.py --calibrate --output profile.json model=gpt2

(`python scripts/plan.py ...` in a checkout is the same command.) Arguments after the options
are the same overrides megalite-pretrain takes; the configuration is validated as for a run.
With --search, the layout keys given (tp, cp, parallel.cp_comm, pp, zero, sp,
parallel.virtual_stages, train.micro_batch_size, train.recompute, offload.activations) are
held fixed and the search covers the rest. Exit status 3 when a stage's estimate exceeds
--gpu-memory-gib, 4 when no layout of the search fits.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from megalite.plan.devices import BY_NAME, device_profile, load_profile_file, table_links

FIT_DEFAULT_DEVICE = "h100-80gb"  # prices --gpu-memory-gib's suggestion without --device


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, help="ranks (GPUs) in all (not with --calibrate)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="ranks per node: which groups cross nodes (default: the profile's, "
                        "8 for cuda)")
    p.add_argument("--device", default="cuda",
                   help=f"a device profile ({', '.join(BY_NAME)}): memory plan and predicted "
                        "time; cuda = a GPU of unknown type (memory plan only); decides the "
                        "dtype where precision=auto (bf16 on GPUs)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="a calibrated device profile file (instead of --device)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="flag stages whose estimate exceeds this much memory per device")
    p.add_argument("--search", action="store_true",
                   help="rank every valid layout that fits by predicted step time")
    p.add_argument("--top", type=int, default=5, help="--search: layouts to print")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="--search: step time vs peak memory of the candidates, to a PNG "
                   "(matplotlib: the eval extra)")
    p.add_argument("--document-tokens", type=int, default=None, metavar="L",
                   help="train.attention_mask=document: price the mask (the plan, and "
                        "every layout --search predicts) for documents of L tokens each "
                        "(default: sampled from data.dir's corpus, each dataset "
                        "of data.blend, where prepared, else no saving assumed; "
                        "megalite/plan/document_terms.py)")
    p.add_argument("--moe-imbalance-from", default=None, metavar="RUN_DIR",
                   help="with ep > 1: set planner.moe_imbalance (the busiest EP rank's routed "
                        "rows over the mean) from an MoE run's logged per-layer imbalance "
                        "(its metrics.jsonl; megalite/cli/plan_moe.py)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine instead (matmul rate at the model's shapes; under "
                        "torchrun, collective bandwidth) and save a device profile "
                        "(megalite/plan/calibrate.py)")
    p.add_argument("--output", default="device-profile.json",
                   help="with --calibrate: the profile file to write")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model=gpt2 tp=2")
    return p


def _profile(cli: argparse.ArgumentParser, args):
    """The device profile (None for --device cuda) and the ranks per node."""
    if args.profile is not None:
        try:
            profile = load_profile_file(args.profile)
        except ValueError as e:
            cli.error(str(e))
    elif args.device == "cuda":
        profile = None
    else:
        try:
            profile = device_profile(args.device)
        except ValueError as e:
            cli.error(f"--device: {e}; or cuda (memory plan only)")
    per_node = args.gpus_per_node or (profile.gpus_per_node if profile else 8)
    if per_node < 1 or (args.world_size > per_node and args.world_size % per_node):
        cli.error(f"--gpus-per-node={per_node} must divide --world-size={args.world_size} "
                  f"(whole nodes), e.g. {[d for d in (1, 2, 4, 8, 16) if args.world_size % d == 0][-1]}")
    return profile, per_node


def main(argv: Optional[List[str]] = None) -> None:
    """`megalite-plan --world-size N [overrides]`; argv defaults to the command line."""
    cli = parser()
    args = cli.parse_args(argv)  # --help and argparse's refusals: before torch is imported
    if args.calibrate:
        from megalite.cli.calibrate import calibrate_command

        sys.exit(calibrate_command(args.overrides, args.output, table_links))
    if args.world_size is None:
        cli.error("the following arguments are required: --world-size")
    profile, per_node = _profile(cli, args)
    if args.moe_imbalance_from is not None:
        from megalite.cli.plan_moe import measured_override

        try:
            args.overrides.append(measured_override(args.moe_imbalance_from))
        except ValueError as e:
            cli.error(f"--moe-imbalance-from: {e}")
    if args.document_tokens is not None and args.document_tokens < 1:
        cli.error(f"--document-tokens={args.document_tokens}: must be >= 1 (tokens a "
                  "document, e.g. 1024)")
    if args.search or args.plot:
        if profile is None:
            cli.error("--search needs a device profile: --device NAME or --profile FILE")
        from megalite.cli.plan_search import run_search

        sys.exit(run_search(args, profile, per_node))
    plan_one(cli, args, profile, per_node)


def plan_one(cli: argparse.ArgumentParser, args, profile, per_node: int) -> None:
    """One layout's memory plan (and prediction, with a profile) and --gpu-memory-gib's
    advice."""
    from megalite.cli.validated import config_for_world
    from megalite.config.layout import Layout
    from megalite.plan.document_terms import describe_mask, masked_work, run_cp_work
    from megalite.plan.fit import cheapest_fit
    from megalite.plan.memory import GIB, make_plan
    from megalite.plan.time_model import predict

    device_type = "cuda" if profile is None else profile.device_type
    bf16 = profile is None or "bf16" in profile.matmul_tflops
    cfg = config_for_world(args.overrides, args.world_size, per_node, device_type)
    layout = Layout.from_config(cfg, args.world_size, device_type, bf16)
    plan = make_plan(cfg, layout)
    work = masked_work(cfg, args.document_tokens)
    prediction = None
    if profile is not None:
        prediction = predict(cfg, layout, plan.stages, profile, per_node,
                             masked_work=work)
    if args.json:
        print(json.dumps({**plan.as_dict(), "prediction":
                          prediction.as_dict() if prediction else None}, indent=1))
    else:
        print(plan.table())
        if work is not None and prediction is None:
            print(f"{describe_mask(cfg, layout, work, run_cp_work(cfg, layout, work))}; "
                  "a device profile prices it")
        if prediction is not None:
            print(prediction.summary())
    if args.gpu_memory_gib is not None:
        if args.gpu_memory_gib <= 0:
            cli.error(f"--gpu-memory-gib={args.gpu_memory_gib}: must be > 0 (e.g. 80)")
        over = [s for s in plan.stages if s.bytes["total"] > args.gpu_memory_gib * GIB]
        timed_on = profile or device_profile(FIT_DEFAULT_DEVICE)  # the added time's profile
        fit = cheapest_fit(cfg, layout, args.gpu_memory_gib * GIB, timed_on, per_node) \
            if over else None
        advice = f"the cheapest placement that fits: {fit.describe()}" \
            + ("" if profile else f" (times on the {FIT_DEFAULT_DEVICE} table entry; "
               "--device or --profile for yours)") if fit is not None \
            else "no placement change fits alone"
        for s in over:
            print(f"megalite: stage {s.stage} needs about {s.bytes['total'] / GIB:.1f} GiB per "
                  f"rank > {args.gpu_memory_gib:g} GiB; {advice}; or raise tp or pp, or lower "
                  "train.micro_batch_size (--search ranks the layouts that fit)",
                  file=sys.stderr)
        if over:
            sys.exit(3)


if __name__ == "__main__":
    main()
