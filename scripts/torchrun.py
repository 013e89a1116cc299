#!/usr/bin/env python
"""torchrun with an ending a user and a scheduler can read: a failed run prints one line per
distinct reason (the ranks' own messages, e.g. the configuration key refused) instead of
torchrun's 40-line traceback, and exits 75 when a worker stopped on a hardware fault (retry
elsewhere), else the first failed worker's own status (2: a bad configuration).

    python scripts/torchrun.py --standalone --nproc_per_node=2 scripts/pretrain.py tp=2

The arguments are torchrun's. The `megalite-torchrun` command of an installed megalite
(`pip install -e .`), whose code (megalite/cli/torchrun.py) this file runs.
"""
from megalite.cli.torchrun import main

if __name__ == "__main__":
    main()
