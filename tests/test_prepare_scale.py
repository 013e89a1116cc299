"""Preparation at scale: resuming a killed preparation, streaming = downloading, the format-1
directories, and the errors before any work (presets, sources that cannot load, fields)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import numpy as np
import pytest

from megalite.config.errors import ConfigError
from megalite.config.schema import DataConfig, load_config
from megalite.data import prepare as prepare_module
from megalite.data.errors import DataError
from megalite.data.loader import META_FILE, TokenShards, check_data
from megalite.data.prepare import prepare
from megalite.data.writer import MANIFEST, ShardWriter
from tests.conftest import shard_arrays

REPO = Path(__file__).resolve().parent.parent
SHARD_TOKENS = 600
BATCH = 16  # documents per tokenized batch in these tests: many manifest commits


@pytest.fixture(autouse=True)
def _hf_cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(prepare_module, "DOCS_PER_BATCH", BATCH)


def made_up_documents(n: int) -> list:
    rng = np.random.default_rng(0)
    words = ["data", "model", "token", "shard", "résumé", "pipeline", "<|endoftext|>", "λ"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 60)))) if i % 23 else ""
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A jsonl corpus of 400 made-up documents (every 23rd empty) with a second field."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "url": f"u{i}"}) + "\n"
                            for i, t in enumerate(made_up_documents(400))))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, corpus) -> Path:
    """A 300-token byte-level BPE trained locally on the corpus."""
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    prepare_module.train_tokenizer(iter(texts), 300).save_pretrained(out)
    return out


def json_config(corpus: Path, tokenizer: str, **kw) -> DataConfig:
    return DataConfig(**{"source": "json", "data_files": [str(corpus)], "tokenizer": tokenizer,
                         "val_fraction": 0.1, "num_proc": 1, "shard_tokens": SHARD_TOKENS, **kw})


def shard_bytes(data_dir: Path) -> dict:
    meta = json.loads((data_dir / META_FILE).read_text())
    return {s: b"".join((data_dir / e["file"]).read_bytes() for e in meta["splits"][s]["shards"])
            for s in ("train", "val")}


# --- resuming -------------------------------------------------------------------------------

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
""" % BATCH)


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


def test_resume_checks_what_it_resumes_from(corpus, tokenizer_dir, tmp_path, monkeypatch):
    """Interrupted right after its 5th shard is renamed complete (before the manifest lists
    it): a copy resumes to the uninterrupted bytes; a changed setting, a changed or missing
    shard are refused naming the key or the file."""
    cfg = json_config(corpus, str(tokenizer_dir))
    prepare(cfg, tmp_path / "reference", progress=False)
    finish, calls = ShardWriter._finish_shard, []

    def finish_then_fail(self):
        finish(self)
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # interrupted, as by Ctrl-C
    monkeypatch.setattr(ShardWriter, "_finish_shard", finish_then_fail)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, tmp_path / "d", progress=False)
    monkeypatch.setattr(ShardWriter, "_finish_shard", finish)
    partial_dir = tmp_path / "d.tmp"
    shutil.copytree(partial_dir, tmp_path / "copy.tmp")
    assert prepare(cfg, tmp_path / "copy", progress=False)["splits"]["train"]["shards"][4]
    assert shard_bytes(tmp_path / "copy") == shard_bytes(tmp_path / "reference")
    with pytest.raises(DataError, match=r"data.val_fraction=0.2: .*d.tmp holds an interrupted "
                                        r"preparation made with data.val_fraction=0.1"):
        prepare(json_config(corpus, str(tokenizer_dir), val_fraction=0.2), tmp_path / "d",
                progress=False)
    tok = partial_dir / "tokenizer" / "tokenizer.json"
    original = tok.read_text()
    swapped = json.loads(original)  # the same vocabulary, two tokens' ids exchanged
    vocab = swapped["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok.write_text(json.dumps(swapped))
    with pytest.raises(DataError, match=r"tokenizer: differs from the tokenizer"):
        prepare(cfg, tmp_path / "d", progress=False)
    tok.write_text(original)
    shard = partial_dir / "train_00001.bin"
    data = bytearray(shard.read_bytes())
    data[7] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"train_00001.bin: its CRC32 differs .* delete"):
        prepare(cfg, tmp_path / "d", progress=False)
    shard.unlink()
    with pytest.raises(DataError, match=r"train_00001.bin: listed in progress.json but missing"):
        prepare(cfg, tmp_path / "d", progress=False)


# --- streaming ------------------------------------------------------------------------------


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


# --- the format-1 directories ---------------------------------------------------------------


def test_a_format_1_directory_still_loads():
    """tests/fixtures/data_v1 was written by the format-1 preparation (commit 11dcc41):
    12 made-up documents, the split a seeded permutation."""
    data = REPO / "tests" / "fixtures" / "data_v1"
    meta = json.loads((data / META_FILE).read_text())
    assert meta["format_version"] == 1 and "split" not in meta
    check_data([data], seq_len=16, global_batch_size=4, model_vocab=300, evaluates=True)
    for split in ("train", "val"):
        shards = TokenShards(data, split)
        tokens = np.concatenate([np.asarray(s) for s in shard_arrays(shards)])
        assert len(tokens) == meta["splits"][split]["tokens"]
        assert (tokens == meta["eos_token_id"]).sum() == meta["splits"][split]["documents"]
    assert TokenShards(data, "train").sample(3, 16).shape == (17,)


# --- errors before any work -----------------------------------------------------------------


def test_unknown_preset_names_the_group_and_the_presets():
    with pytest.raises(ConfigError, match=r"data='fineweb_edux': no such preset; use one of "
                                          r"fineweb, fineweb_edu, local, openwebtext"):
        load_config(["data=fineweb_edux"])
    cfg = load_config(["data=fineweb_edu"])
    assert (cfg.data.source, cfg.data.config_name, cfg.data.tokenizer, cfg.data.streaming) == (
        "HuggingFaceFW/fineweb-edu", "sample-10BT", "gpt2", True)
    assert load_config(["data=fineweb"]).data.source == "HuggingFaceFW/fineweb"
    assert load_config(["data=openwebtext"]).data.revision == "main"


def test_pretrain_refuses_an_unknown_preset_before_hydra(monkeypatch, capsys):
    from megalite.cli import pretrain

    monkeypatch.setattr("sys.argv", ["megalite-pretrain", "tp=1", "data=fineweb_edux"])
    with pytest.raises(SystemExit) as exit_info:
        pretrain.main()
    assert exit_info.value.code == 2
    assert "data='fineweb_edux': no such preset; use one of fineweb, fineweb_edu" in \
        capsys.readouterr().err


def test_sources_that_cannot_load_are_named_with_a_remedy(tmp_path, corpus, monkeypatch):
    scripted = tmp_path / "scripted"
    scripted.mkdir()
    (scripted / "scripted.py").write_text("import datasets\n")
    with pytest.raises(DataError, match=r"scripted.* is a loading-script dataset.*datasets>=4.*"
                                        r"data.revision=refs/convert/parquet"):
        prepare(DataConfig(source=str(scripted), tokenizer="train"), tmp_path / "a",
                progress=False)
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "a.jsonl").write_text('{"text": "a"}\n')
    (configs / "README.md").write_text("---\nconfigs:\n- config_name: one\n  data_files: a.jsonl"
                                       "\n- config_name: two\n  data_files: a.jsonl\n---\n")
    with pytest.raises(DataError, match=r"data.config_name=None: .* needs one of its configs "
                                        r"\['one', 'two'\]"):
        prepare(DataConfig(source=str(configs), tokenizer="train"), tmp_path / "b",
                progress=False)
    import huggingface_hub.constants
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"'nobody/no-such-corpus' is not reachable on the Hugging "
                                        r"Face hub .* not in the local cache"):
        prepare(DataConfig(source="nobody/no-such-corpus", streaming=True, tokenizer="train",
                           tokenizer_train_documents=10), tmp_path / "c", progress=False)
    with pytest.raises(DataError, match=r"data.text_field='body': .* has the fields "
                                        r"\['text', 'url'\]"):
        prepare(json_config(corpus, "train", text_field="body", streaming=True,
                            tokenizer_train_documents=10), tmp_path / "d", progress=False)
    with pytest.raises(DataError, match=r"data.tokenizer=train with data.streaming=true: .*"
                                        r"data.tokenizer_train_documents=100000"):
        prepare(json_config(corpus, "train", streaming=True), tmp_path / "e", progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name.split(".")[0] in "abcde"]  # nothing
