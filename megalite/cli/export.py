"""Export a megalite checkpoint (any tp/pp/dp/zero layout) as a `transformers` directory, or as
torchtitan's Llama 3 DCP checkpoint (docs/checkpoints.md).

    megalite-export outputs/run/checkpoints/step_00000300 exported/gpt2-run
    megalite-export outputs/run/checkpoints exported/gpt2-run   # latest checkpoint
    megalite-export CKPT OUT --max-shard-size 2GB                # safetensors shards + index
    megalite-export CKPT OUT --part 0/4 & ... --part 3/4         # 4 processes, a quarter each
    torchrun --nproc-per-node 4 -m megalite.cli.export CKPT OUT --format dcp   # torchtitan

(`python scripts/export_hf.py ...` in a checkout is the same command.) Writes config.json,
model.safetensors (or model-0000N-of-0000M.safetensors and model.safetensors.index.json),
generation_config.json and the tokenizer the run's data was prepared with
(`<data.dir>/tokenizer`; data.dir is taken from the checkpoint and a relative one is relative
to the launch directory, or give --tokenizer DIR). Then

    GPT2LMHeadModel.from_pretrained("exported/gpt2-run")
    AutoTokenizer.from_pretrained("exported/gpt2-run")

The safetensors shards are written one at a time from the checkpoint's rank files (memory:
about one shard). An existing non-empty OUT_DIR is replaced only with --force, and only once
the new export is complete; the export appears complete or not at all (with --part, the last
part to finish writes the index; the parts export one step of a checkpoint directory, the one
the first part found, and refuse the files of another export).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import List, Optional, Tuple

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.export import DEFAULT_SHARD_BYTES, export_hf
from megalite.checkpoint.resolve import CheckpointNotFound

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}


def shard_bytes(text: str) -> int:
    """--max-shard-size: bytes, or a number with KB/MB/GB (powers of 10, as transformers) or
    KiB/MiB/GiB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"--max-shard-size={text!r}: give a positive size "
                                         "such as 2GB, 500MB or 1073741824")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def part_of(text: str) -> Tuple[int, int]:
    """--part I/N: this process writes shards I, I + N, ... (0 <= I < N)."""
    match = re.fullmatch(r"(\d+)/(\d+)", text)
    if match is None or not int(match.group(1)) < int(match.group(2)):
        raise argparse.ArgumentTypeError(f"--part={text!r}: give I/N with 0 <= I < N, e.g. 0/4")
    return int(match.group(1)), int(match.group(2))


def _export_dcp(args) -> object:
    """--format dcp in this process, or in every rank torchrun started (gloo)."""
    import torch.distributed as dist

    from megalite.checkpoint.dcp_export import export_dcp

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        return export_dcp(args.checkpoint, args.out_dir, args.force)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> None:
    """`megalite-export CHECKPOINT OUT_DIR`; argv defaults to the command line."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory step_NNNNNNNN, or a "
                        "checkpoint.dir (its latest complete checkpoint)")
    parser.add_argument("out_dir", help="the transformers directory to write")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's "
                        "<data.dir>/tokenizer)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    parser.add_argument("--format", choices=("hf", "dcp"), default="hf", help="hf: a "
                        "transformers directory (default); dcp: torchtitan's Llama 3 DCP "
                        "checkpoint (run under torchrun: each rank writes its share)")
    parser.add_argument("--max-shard-size", type=shard_bytes, default=DEFAULT_SHARD_BYTES,
                        help="hf: the largest safetensors shard (default 5GB, as transformers)")
    parser.add_argument("--part", type=part_of, default=(0, 1), help="hf: I/N, this process "
                        "writes every N-th shard from the I-th into OUT_DIR (run N processes)")
    args = parser.parse_args(argv)
    try:
        if args.format == "dcp":
            ckpt = _export_dcp(args)
        else:
            ckpt = export_hf(args.checkpoint, args.out_dir, args.tokenizer, args.force,
                             args.max_shard_size, args.part)
    except (CheckpointError, CheckpointNotFound) as e:
        print(f"megalite: cannot export: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {ckpt} to {args.out_dir}")


if __name__ == "__main__":
    main()
