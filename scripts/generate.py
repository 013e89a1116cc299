#!/usr/bin/env python
"""Sample text from a megalite checkpoint of any layout.

    python scripts/generate.py outputs/run/checkpoints --prompt "def main(" --max-new-tokens 64
    python scripts/generate.py CKPT --prompt "import os" --temperature 0        # greedy

Loads the checkpoint into the serial GPT-2 (one process), encodes the prompt with the run's
tokenizer (`<data.dir>/tokenizer`, or --tokenizer DIR), samples, and prints prompt and
continuation, up to the end of the document (the EOS token; --ignore-eos samples on past it).
The same --seed gives the same text (on the same device). An empty prompt starts from the EOS
token.

The `megalite-generate` command of an installed megalite (`pip install -e .`), whose code
(megalite/cli/generate.py) this file runs.
"""
from megalite.cli.generate import main

if __name__ == "__main__":
    main()
