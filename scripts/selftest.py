#!/usr/bin/env python
"""A day-one check of a cluster before a long job: every layout class that fits the launch
against the serial run, a checkpoint resumed under another layout, the links against the device
table; a report (JSON and text), exit status 1 when a check fails.

    torchrun --standalone --nproc_per_node=8 scripts/selftest.py
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        scripts/selftest.py checkpoint.dir=/shared/ckpt

The `megalite-selftest` command of an installed megalite, whose code (megalite/cli/selftest.py)
this file runs.
"""
from megalite.cli.selftest import main

if __name__ == "__main__":
    main()
