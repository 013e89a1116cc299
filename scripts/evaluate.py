#!/usr/bin/env python
"""Evaluate a run's model with EleutherAI's lm-eval harness on its `transformers` export.

    python scripts/evaluate.py outputs/run/checkpoints --tasks hellaswag,arc_easy
    python scripts/evaluate.py CKPT --tasks my_task --include-path my_tasks/   # local yaml tasks

The `megalite-evaluate` command of an installed megalite (`pip install -e ".[eval]"`: lm-eval,
accelerate, matplotlib), whose code (megalite/cli/evaluate.py) this file runs.
"""
from megalite.cli.evaluate import main

if __name__ == "__main__":
    main()
