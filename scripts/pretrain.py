#!/usr/bin/env python
"""Pretrain a GPT-2 or Llama model with megalite.

    torchrun --nproc_per_node=8 scripts/pretrain.py model=gpt2 train.seq_len=1024
    python scripts/pretrain.py                      # tiny preset on the embedded stdlib corpus

The run directory is Hydra's output directory (`hydra.run.dir`); metrics.jsonl, the wandb run
and (by default) checkpoints go there. The configuration is validated, the token shards (and
the init_from and resume checkpoints' model shape) checked, before any process group is
created.

The `megalite-pretrain` command of an installed megalite (`pip install -e .`), whose code
(megalite/cli/pretrain.py) this file runs.
"""
from megalite.cli.pretrain import main

if __name__ == "__main__":
    main()
