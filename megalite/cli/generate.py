"""Sample text from a megalite checkpoint of any layout.

    megalite-generate outputs/run/checkpoints --prompt "def main(" --max-new-tokens 64
    megalite-generate CKPT --prompt "import os" --temperature 0        # greedy

(`python scripts/generate.py ...` in a checkout is the same command.) Loads the checkpoint into
the serial GPT-2 (one process), encodes the prompt with the run's tokenizer
(`<data.dir>/tokenizer`, or --tokenizer DIR), samples, and prints prompt and continuation, up
to the end of the document (the EOS token; --ignore-eos samples on past it). The same --seed
gives the same text (on the same device). An empty prompt starts from the EOS token.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.export import load_model, load_tokenizer
from megalite.checkpoint.resolve import resolve_checkpoint
from megalite.model.generate import generate
from megalite.utils.device import default_device


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory step_NNNNNNNN, or a "
                        "checkpoint.dir (its latest complete checkpoint)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default=default_device())
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep sampling after the end-of-document token")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's "
                        "<data.dir>/tokenizer)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    """`megalite-generate CHECKPOINT --prompt TEXT`; argv defaults to the command line."""
    args = parse_args(argv)
    try:
        ckpt = resolve_checkpoint(args.checkpoint)
        tokenizer = load_tokenizer(ckpt, args.tokenizer)
        model = load_model(ckpt, args.device)
        ids = tokenizer.encode(args.prompt, add_special_tokens=False) or [tokenizer.eos_token_id]
        generator = torch.Generator(args.device).manual_seed(args.seed)
        out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k,
                       generator, vocab_size=len(tokenizer),
                       eos_token_id=None if args.ignore_eos else tokenizer.eos_token_id)
    except (CheckpointError, ValueError) as e:
        print(f"megalite: cannot generate: {e}", file=sys.stderr)
        sys.exit(2)
    print(tokenizer.decode(out))


if __name__ == "__main__":
    main()
