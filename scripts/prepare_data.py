#!/usr/bin/env python
"""Prepare token shards for pretraining (the `data` section of conf/config.yaml).

    python scripts/prepare_data.py                                  # stdlib corpus, offline
    python scripts/prepare_data.py data=openwebtext data.num_proc=32
    python scripts/prepare_data.py data=local data.source=json data.data_files=[/data/a.jsonl]

Writes `data.dir` (relative to the launch directory). A directory that already holds a complete
meta.json is left alone ("already prepared"); delete it to rebuild. Creates no Hydra output
directory.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra  # noqa: E402

from megalite.config import ConfigError, register_configs, resolve_path, to_config  # noqa: E402
from megalite.data.loader import SPLITS, DataError, TokenShards  # noqa: E402
from megalite.data.prepare import prepare  # noqa: E402

register_configs()

# A data-preparation run has no run directory: no outputs/<date>/, no .hydra/, no log file.
NO_HYDRA_OUTPUT = ["hydra.output_subdir=null", "hydra.run.dir=.",
                   "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def summary(meta: dict, out_dir: Path) -> str:
    lines = [f"data.dir={out_dir}",
             f"  tokenizer: {meta['tokenizer']['name']} (vocab {meta['vocab_size']}, "
             f"eos id {meta['eos_token_id']}, saved in {out_dir / meta['tokenizer']['dir']})",
             f"  dtype: {meta['dtype']}"]
    for split in SPLITS:
        s = meta["splits"][split]
        lines.append(f"  {split}: {s['tokens']:,} tokens, {s['documents']:,} documents, "
                     f"{len(s['shards'])} shard(s)")
    return "\n".join(lines)


def already_prepared(out_dir: Path) -> bool:
    """True when out_dir holds a meta.json whose shards all open and check out."""
    if not (out_dir / "meta.json").is_file():
        return False
    for split in SPLITS:
        TokenShards(out_dir, split)  # raises DataError, naming the file, if incomplete
    return True


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(node) -> None:
    cfg = to_config(node)
    out_dir = resolve_path(cfg.data.dir)
    try:
        if already_prepared(out_dir):
            meta = TokenShards(out_dir, "train").meta
            print(f"already prepared (delete {out_dir} to rebuild)\n{summary(meta, out_dir)}")
            return
        start = time.perf_counter()
        meta = prepare(cfg.data, out_dir, progress=cfg.log.progress)
    except (ConfigError, DataError) as e:
        print(f"megalite: bad data configuration: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"prepared in {time.perf_counter() - start:.1f}s\n{summary(meta, out_dir)}")


if __name__ == "__main__":
    sys.argv += NO_HYDRA_OUTPUT
    main()
