#!/usr/bin/env python
"""Export a megalite checkpoint (any tp/pp/dp/zero layout) as a `transformers` GPT-2 directory.

    python scripts/export_hf.py outputs/run/checkpoints/step_00000300 exported/gpt2-run
    python scripts/export_hf.py outputs/run/checkpoints exported/gpt2-run   # latest checkpoint

Writes config.json, model.safetensors, generation_config.json and the tokenizer the run's data
was prepared with (`<data.dir>/tokenizer`; data.dir is taken from the checkpoint and a relative
one is relative to the launch directory, or give --tokenizer DIR). Then

    GPT2LMHeadModel.from_pretrained("exported/gpt2-run")
    AutoTokenizer.from_pretrained("exported/gpt2-run")

An existing non-empty OUT_DIR is replaced only with --force; the export appears complete or
not at all.

The `megalite-export` command of an installed megalite (`pip install -e .`), whose code
(megalite/cli/export.py) this file runs.
"""
from megalite.cli.export import main

if __name__ == "__main__":
    main()
