#!/usr/bin/env python
"""Sample text from a megalite checkpoint of any layout.

    python scripts/generate.py outputs/run/checkpoints --prompt "def main(" --max-new-tokens 64
    python scripts/generate.py CKPT --prompt "import os" --temperature 0        # greedy

Loads the checkpoint into the serial GPT-2 (one process), encodes the prompt with the run's
tokenizer (`<data.dir>/tokenizer`, or --tokenizer DIR), samples, and prints prompt and
continuation, up to the end of the document (the EOS token; --ignore-eos samples on past it).
The same --seed gives the same text (on the same device). An empty prompt starts from the EOS
token.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from megalite.model.generate import generate  # noqa: E402
from megalite.checkpoint.export import load_model, load_tokenizer  # noqa: E402
from megalite.checkpoint.format import CheckpointError  # noqa: E402
from megalite.checkpoint.resolve import resolve_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("checkpoint", help="a checkpoint directory step_NNNNNNNN, or a "
                        "checkpoint.dir (its latest complete checkpoint)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep sampling after the end-of-document token")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's "
                        "<data.dir>/tokenizer)")
    args = parser.parse_args()
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
