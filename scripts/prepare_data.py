#!/usr/bin/env python
"""Prepare token shards for pretraining (the `data` section of conf/config.yaml).

    python scripts/prepare_data.py                                  # stdlib corpus, offline
    python scripts/prepare_data.py data=fineweb_edu data.num_proc=32   # streamed from the hub
    python scripts/prepare_data.py data=local data.source=json data.data_files=[/data/a.jsonl]

Writes `data.dir` (relative to the launch directory). A directory that already holds a complete
meta.json is left alone ("already prepared"); delete it to rebuild. An interrupted preparation
(its `<dir>.tmp`) resumes from its last complete shard when run again with the same settings.
Creates no Hydra output directory.

The `megalite-prepare` command of an installed megalite (`pip install -e .`), whose code
(megalite/cli/prepare.py) this file runs.
"""
from megalite.cli.prepare import main

if __name__ == "__main__":
    main()
