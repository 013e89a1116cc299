"""Preparation at scale: resuming a killed preparation, streaming = downloading, the format-1
directories, and the errors before any work (presets, sources that cannot load, fields)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest

from megalite.config.errors import ConfigError
from megalite.config.schema import DataConfig, load_config
from megalite.data.errors import DataError
from megalite.data.loader import META_FILE, TokenShards, check_data
from megalite.data.prepare import prepare
from megalite.data.writer import ShardWriter
from tests.conftest import shard_arrays
from tests.data_fixtures import json_config, shard_bytes

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("small_prepare_batches")


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
