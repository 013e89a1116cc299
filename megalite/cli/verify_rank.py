"""`megalite-verify-rank` (`scripts/verify_rank.py`): build rank R of an N-rank layout on this
machine, its collectives simulated and its tensors on the meta device, next to the plan
(`megalite.train.simulated`, whose docstring says what is real and what is simulated).

    python scripts/verify_rank.py --verify-rank R --world-size N [--device cuda|cpu] [--json] \\
        model=gpt2-xl pp=2 zero=3 train.seq_len=1024 train.micro_batch_size=4 ...
"""
from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verify_rank.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verify-rank", type=int, required=True,
                        help="the rank to build, in [0, --world-size)")
    parser.add_argument("--world-size", type=int, required=True, help="ranks (GPUs) in all")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="the device kind of the simulated launch: decides the dtype "
                             "where precision=auto (bf16 on cuda); tensors stay on meta")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="for the check that a TP group fits in a node (--device cuda)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model=gpt2 tp=2")
    return parser


def main(argv=None) -> None:
    """The command line (see the module docstring); exit status 2 on a bad argument or
    configuration, 1 without the fake backend."""
    parser = _parser()
    args = parser.parse_args(argv)  # --help and argparse's refusals: before torch is imported
    from megalite.cli.validated import config_for_world
    from megalite.config.layout import Layout
    from megalite.train.simulated import FakeBackendMissing, verify_rank

    cfg = config_for_world(args.overrides, args.world_size, args.gpus_per_node, args.device)
    if not 0 <= args.verify_rank < args.world_size:
        parser.error(f"--verify-rank={args.verify_rank}: must be a rank of the layout, in "
                     f"[0, --world-size={args.world_size}), e.g. 0 (first pipeline stage) or "
                     f"{args.world_size - 1} (last)")
    layout = Layout.from_config(cfg, args.world_size, args.device)
    try:
        result = verify_rank(cfg, layout, args.verify_rank)
    except FakeBackendMissing as e:
        print(f"megalite: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(result.as_dict(), indent=1) if args.json else result.table())


if __name__ == "__main__":
    main()
