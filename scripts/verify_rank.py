#!/usr/bin/env python
"""Build rank R of an N-rank layout for real on this machine (collectives on PyTorch's fake
backend, tensors on the meta device) and print its planned and built bytes per state:

    python scripts/verify_rank.py --verify-rank 4095 --world-size 4096 model=gpt2-xl pp=2 \\
        zero=3 train.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=8192

The `megalite-verify-rank` command of an installed megalite (`pip install -e .`), whose code
(megalite/cli/verify_rank.py) this file runs.
"""
from megalite.cli.verify_rank import main

if __name__ == "__main__":
    main()
