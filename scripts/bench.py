#!/usr/bin/env python
"""megalite benchmarks, each side by side with a reference in the same run (ratios, not
absolute times). One subcommand per benchmark; `--help` on each lists its options.

    python scripts/bench.py train --presets tiny gpt2 --seq-len 256 --micro-batch 4
    python scripts/bench.py train --presets gpt2-xl --micro-batch 16 12 8 --compile 0 1   # GPU
    python scripts/bench.py gpu       # everything to measure on one GPU, ~6 minutes

The `megalite-bench` command of an installed megalite (`pip install -e .`), whose code
(megalite_bench/cli.py) this file runs.
"""
from megalite_bench.cli import main

if __name__ == "__main__":
    main()
