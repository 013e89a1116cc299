"""Prepare token shards for pretraining (the `data` section of conf/config.yaml).

    megalite-prepare                                  # stdlib corpus, offline
    megalite-prepare data=fineweb_edu data.num_proc=32   # streamed from the hub
    megalite-prepare data=local data.source=json data.data_files=[/data/a.jsonl]

(`python scripts/prepare_data.py ...` in a checkout is the same command.) Writes `data.dir`
(relative to the launch directory). A directory that already holds a complete meta.json is
left alone ("already prepared"); delete it to rebuild. An interrupted preparation (its
`<dir>.tmp`) resumes from its last complete shard when run again with the same settings.
Creates no Hydra output directory.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import hydra

from megalite.cli import NO_HYDRA_OUTPUT
from megalite.config.errors import ConfigError
from megalite.config.schema import CONF_DIR, check_presets, register_configs, resolve_path, to_config
from megalite.data.errors import DataError
from megalite.data.loader import SPLITS, TokenShards
from megalite.data.prepare import prepare


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


# The configs by absolute path: megalite/conf, the checkout's conf/ or an installed package's
# copy (a `pkg://` path would need an __init__.py in the config directory).
@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def prepare_data(node) -> None:
    cfg = to_config(node)
    out_dir = resolve_path(cfg.data.dir)
    try:
        if already_prepared(out_dir):
            meta = TokenShards(out_dir, "train").meta
            print(f"already prepared (delete {out_dir} to rebuild)\n{summary(meta, out_dir)}")
            vocab_note(meta, cfg.model)
            return
        start = time.perf_counter()
        meta = prepare(cfg.data, out_dir, progress=cfg.log.progress)
    except (ConfigError, DataError) as e:
        print(f"megalite: bad data configuration: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"prepared in {time.perf_counter() - start:.1f}s\n{summary(meta, out_dir)}")
    vocab_note(meta, cfg.model)


def vocab_note(meta: dict, model) -> None:
    """Says so when the data's tokenizer does not fit the configured model (training refuses
    it before launch, naming model.vocab_size)."""
    if meta["vocab_size"] > model.vocab_size:
        print(f"megalite: note: the tokenizer has {meta['vocab_size']} tokens, more than "
              f"model.vocab_size={model.vocab_size} (model={model.name}); train with "
              f"model.vocab_size>={meta['vocab_size']}, e.g. model=gpt2 (50257)", file=sys.stderr)


def main() -> None:
    """`megalite-prepare [overrides]`: Hydra reads the overrides from the command line."""
    try:
        check_presets(sys.argv[1:])
    except ConfigError as e:
        print(f"megalite: bad data configuration: {e}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=logging.INFO, format="megalite: %(message)s")
    register_configs()
    sys.argv += NO_HYDRA_OUTPUT  # a data-preparation run has no run directory
    prepare_data()


if __name__ == "__main__":
    main()
