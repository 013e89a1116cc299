"""Export a megalite checkpoint (any tp/pp/dp/zero layout) as a `transformers` GPT-2 directory.

    megalite-export outputs/run/checkpoints/step_00000300 exported/gpt2-run
    megalite-export outputs/run/checkpoints exported/gpt2-run   # latest checkpoint

(`python scripts/export_hf.py ...` in a checkout is the same command.) Writes config.json,
model.safetensors, generation_config.json and the tokenizer the run's data was prepared with
(`<data.dir>/tokenizer`; data.dir is taken from the checkpoint and a relative one is relative
to the launch directory, or give --tokenizer DIR). Then

    GPT2LMHeadModel.from_pretrained("exported/gpt2-run")
    AutoTokenizer.from_pretrained("exported/gpt2-run")

An existing non-empty OUT_DIR is replaced only with --force; the export appears complete or
not at all.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.export import export_hf
from megalite.checkpoint.resolve import CheckpointNotFound


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
    args = parser.parse_args(argv)
    try:
        ckpt = export_hf(args.checkpoint, args.out_dir, args.tokenizer, args.force)
    except (CheckpointError, CheckpointNotFound) as e:
        print(f"megalite: cannot export: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {ckpt} to {args.out_dir}")


if __name__ == "__main__":
    main()
