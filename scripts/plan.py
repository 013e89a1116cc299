#!/usr/bin/env python
"""Estimate, before launching, what every rank of a layout holds and sends: parameters,
gradients, optimizer state, activations in flight, the ZeRO-3 working set, and the bytes per
optimizer step over the TP, PP, DP and embedding groups (megalite/plan/memory.py has the formulas).

    python scripts/plan.py --world-size 16 model=gpt2-xl pp=2 zero=3 \\
        train.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=512
    python scripts/plan.py --world-size 8 --gpu-memory-gib 80 model=gpt2-xl zero=1 ...

Arguments after the options are the same overrides pretrain.py takes; the configuration is
validated as for a run. Exit status 3 when a stage's estimate exceeds --gpu-memory-gib.

The `megalite-plan` command of an installed megalite (`pip install -e .`), whose code
(megalite/cli/plan.py) this file runs.
"""
from megalite.cli.plan import main

if __name__ == "__main__":
    main()
