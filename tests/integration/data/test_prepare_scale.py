"""Preparation at scale: resuming a killed preparation, streaming = downloading, the format-1
directories, and the errors before any work (presets, sources that cannot load, fields)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megalite.config.schema import DataConfig
from megalite.data import prepare as prepare_module
from megalite.data.loader import META_FILE
from megalite.data.prepare import prepare
from megalite.data.writer import MANIFEST
from tests.data_fixtures import PREPARE_BATCH, SHARD_TOKENS, json_config, made_up_documents, shard_bytes

pytestmark = pytest.mark.usefixtures("small_prepare_batches")

CRASHING_RUN = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import datasets
    from megalite.config.schema import DataConfig
    from megalite.data import prepare as prepare_module
    from megalite.data.writer import ShardWriter
    cfg_json, out, crash_at, before_rename, cache = sys.argv[1:6]
    datasets.config.HF_DATASETS_CACHE = cache
    prepare_module.DOCS_PER_BATCH = %d
    finish, calls = ShardWriter._finish_shard, []
    def finish_then_die(self):
        calls.append(1)
        if len(calls) == int(crash_at) and before_rename == "1":
            self._file.flush()
            os._exit(17)  # the shard's bytes are all written, it is not renamed
        finish(self)
        if len(calls) == int(crash_at):
            os._exit(17)  # the shard is complete, the manifest does not list it yet
    ShardWriter._finish_shard = finish_then_die
    import json
    prepare_module.prepare(DataConfig(**json.loads(cfg_json)), Path(out), progress=False)
""" % PREPARE_BATCH)


def run_until_crash(cfg: DataConfig, out: Path, crash_at: int, before_rename: bool,
                    tmp_path: Path) -> None:
    fields = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    proc = subprocess.run([sys.executable, "-c", CRASHING_RUN, json.dumps(fields), str(out),
                           str(crash_at), str(int(before_rename)), str(tmp_path / "hf_cache")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr


@pytest.mark.distributed
def test_a_killed_preparation_resumes_to_the_same_bytes(corpus, tokenizer_dir, tmp_path):
    cfg = json_config(corpus, str(tokenizer_dir))
    reference = tmp_path / "reference"
    prepare(cfg, reference, progress=False)
    ref_meta = json.loads((reference / META_FILE).read_text())
    assert len(ref_meta["splits"]["train"]["shards"]) >= 8

    out = tmp_path / "resumed"
    partial_dir = tmp_path / "resumed.tmp"
    # killed when its 4th shard has all its bytes, before it is renamed complete (killed right
    # after a rename, before the manifest lists it: test_resume_checks_what_it_resumes_from)
    run_until_crash(cfg, out, 4, before_rename=True, tmp_path=tmp_path)
    assert not out.exists() and not (partial_dir / META_FILE).exists()
    manifest = json.loads((partial_dir / MANIFEST).read_text())
    listed = {e["file"] for s in manifest["splits"].values() for e in s["shards"]}
    for shard in partial_dir.glob("*.bin"):  # a file with a final name is whole
        assert shard.stat().st_size == SHARD_TOKENS * 2, shard
    unlisted = [p for p in partial_dir.glob("*.bin*") if p.name not in listed]
    assert any(p.name.endswith(".partial") and p.stat().st_size == SHARD_TOKENS * 2
               for p in unlisted)  # the killed shard, all its bytes written, is not complete

    meta = prepare(cfg, out, progress=False)
    assert shard_bytes(out) == shard_bytes(reference)
    assert meta == ref_meta and not partial_dir.exists()
    assert not list(out.glob("*.partial")) and not (out / MANIFEST).exists()


@pytest.mark.distributed
def test_streaming_equals_downloading(corpus, tmp_path):
    """The same shards, split and trained tokenizer from a stream (2 tokenizer processes) as from
    the downloaded dataset (1 process); the split is each document's index hashed."""
    kw = {"tokenizer_train_documents": 250, "tokenizer_vocab_size": 280}
    down = prepare(json_config(corpus, "train", **kw), tmp_path / "down", progress=False)
    stream = prepare(json_config(corpus, "train", streaming=True, num_proc=2, **kw),
                     tmp_path / "stream", progress=False)
    assert stream == down and shard_bytes(tmp_path / "stream") == shard_bytes(tmp_path / "down")
    assert ((tmp_path / "stream" / "tokenizer" / "tokenizer.json").read_bytes()
            == (tmp_path / "down" / "tokenizer" / "tokenizer.json").read_bytes())
    docs = made_up_documents(400)
    val = prepare_module.split_documents(400, 0.1)["val"]
    assert down["splits"]["val"]["documents"] == sum(1 for i in val if docs[i])
    assert down["splits"]["train"]["documents"] == sum(1 for d in docs if d) - sum(
        1 for i in val if docs[i])
    assert down["format_version"] == 2 and down["split"]["method"] == "hash-v1"
