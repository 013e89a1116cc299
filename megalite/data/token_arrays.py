"""A prepared-data directory from token arrays already in memory: the synthetic corpora of the
cluster self-test (`megalite.train.selftest`), the benchmarks and the tests, in the format
`megalite.data.loader` reads (meta.json + uint16 shards; `megalite.data.prepare` writes real
corpora). meta.json is written last, so a directory cut short never looks prepared.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from megalite.data.loader import META_FILE
from megalite.data.prepare import FORMAT_VERSION


def write_token_arrays(out: Path, splits: Mapping[str, Sequence[np.ndarray]], vocab_size: int,
                       eos_token_id: int, description: str) -> Path:
    """`out` holding each split's arrays as its shards `<split>_00000.bin`, ... (uint16: token
    ids below 65536), the documents counted by EOS (at least one a split); `description`
    names where the tokens come from (meta.json's tokenizer and source)."""
    if vocab_size > 65536:
        raise ValueError(f"vocab_size={vocab_size}: uint16 shards hold ids below 65536")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)  # rewritten: not prepared until the end
    meta_splits = {}
    for split, arrays in splits.items():
        entries = []
        for k, tokens in enumerate(arrays):
            name = f"{split}_{k:05d}.bin"
            np.asarray(tokens, dtype=np.uint16).tofile(out / name)
            entries.append({"file": name, "tokens": int(len(tokens))})
        documents = int(sum((np.asarray(t) == eos_token_id).sum() for t in arrays))
        meta_splits[split] = {"shards": entries, "tokens": sum(e["tokens"] for e in entries),
                              "documents": max(1, documents)}
    meta = {"format_version": FORMAT_VERSION, "vocab_size": vocab_size, "eos_token_id": eos_token_id,
            "dtype": "uint16", "tokenizer": {"name": f"none ({description})", "dir": "tokenizer"},
            "source": {"source": "synthetic", "config_name": None, "split": "train",
                       "data_files": None, "text_field": None, "max_documents": None},
            "splits": meta_splits}
    (out / META_FILE).write_text(json.dumps(meta, indent=1))
    return out
