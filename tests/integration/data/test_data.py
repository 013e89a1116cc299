"""Data pipeline: prepare (stdlib, json, text), shards, the resumable sampler and the batches."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megalite.config.schema import DataConfig
from megalite.data.loader import (
    META_FILE,
)
from megalite.data.prepare import prepare, split_documents
from tests.data_fixtures import assert_round_trip

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("hf_cache_in_tmp")


@pytest.mark.distributed
def test_text_source_one_document_per_line_with_two_processes(stdlib_data, tmp_path):
    lines = [f"line {i} of the corpus" for i in range(40)]
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    files[0].write_text("\n".join(lines[:25]) + "\n")
    files[1].write_text("\n".join(lines[25:]) + "\n")
    out = tmp_path / "text_data"
    cfg = DataConfig(source="text", data_files=[str(f) for f in files], max_documents=35,
                     tokenizer=str(stdlib_data / "tokenizer"), num_proc=2, val_fraction=0.2)
    meta = prepare(cfg, out, progress=False)
    assert sum(meta["splits"][s]["documents"] for s in ("train", "val")) == 35
    splits = split_documents(35, cfg.val_fraction)
    assert_round_trip(out, {s: [lines[i] for i in idx] for s, idx in splits.items()})


@pytest.mark.distributed
def test_prepare_script_writes_no_hydra_outputs(tmp_path):
    out = tmp_path / "d"
    cmd = [sys.executable, str(REPO / "scripts" / "prepare_data.py"), f"data.dir={out}",
           "data.max_documents=40", "data.tokenizer_vocab_size=300", "data.num_proc=1",
           "log.progress=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "train:" in proc.stdout and "uint16" in proc.stdout
    assert (out / META_FILE).is_file() and (out / "train_00000.bin").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no outputs/, .hydra/ or log file
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already prepared" in again.stdout
