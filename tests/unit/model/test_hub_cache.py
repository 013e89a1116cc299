"""init_from a hub id through huggingface_hub's cache, offline: a cache built here in the hub's
layout (models--<org>--<name>/snapshots/<commit>, refs/main), HF_HUB_OFFLINE=1, no network.
Both families load with the weights saved (a Llama in safetensors shards with their index);
a model not in the cache is one line naming the id and the cache."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.model import ModelConfig
from megalite.model.gpt2 import hf as gpt2_hf
from megalite.model.hf_io import check_init_from, load_hf_state_dict
from megalite.model.llama import hf as hf_llama
from tests.conftest import random_hf_gpt2, random_hf_llama

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GPT2 = ModelConfig(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=100)
LLAMA = ModelConfig(arch="llama", n_layer=2, n_embd=32, n_head=4, n_kv_head=2, n_positions=32,
                    vocab_size=100, n_inner=48, tie_word_embeddings=False)


def cached(cache, repo: str, model, **save) -> None:
    """`model` saved into `cache` as the hub would have downloaded `repo` at COMMIT."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    model.save_pretrained(folder / "snapshots" / COMMIT, **save)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import by the hub
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_hub_ids_load_from_the_cache_offline_both_families(offline_cache):
    llama, gpt2 = random_hf_llama(LLAMA), random_hf_gpt2(GPT2)
    cached(offline_cache, "someone/tiny-llama", llama, max_shard_size="20KB")
    cached(offline_cache, "someone/tiny-gpt2", gpt2)
    snapshot = offline_cache / "models--someone--tiny-llama" / "snapshots" / COMMIT
    assert len(list(snapshot.glob("model-*.safetensors"))) > 1  # the sharded input
    assert (snapshot / "model.safetensors.index.json").is_file()
    for source, cfg, model, mapping in [("someone/tiny-llama", LLAMA, llama, hf_llama),
                                        ("someone/tiny-gpt2", GPT2, gpt2, gpt2_hf)]:
        check_init_from(source, cfg)
        state = load_hf_state_dict(source, cfg)
        want = mapping.from_hf_state_dict(model.state_dict())
        assert state.keys() == want.keys()
        assert all(torch.equal(state[k], want[k]) for k in want)


def test_a_model_neither_cached_nor_reachable_is_one_line(offline_cache):
    with pytest.raises(ConfigError) as e:
        check_init_from("someone/not-downloaded", GPT2)
    message = str(e.value)
    assert "\n" not in message
    assert "init_from='someone/not-downloaded'" in message and str(offline_cache) in message
    assert "HF_HUB_OFFLINE=1" in message


@pytest.fixture
def served_hub(tmp_path, monkeypatch):
    """huggingface_hub's download functions serving repositories the test writes under
    `remote/<org>--<name>` into a snapshot directory, recording every file they hand out;
    (remote, fetched)."""
    import fnmatch
    import shutil

    import huggingface_hub

    remote, fetched = tmp_path / "remote", []

    def snapshot_download(repo_id, allow_patterns=None, **_):
        source = remote / repo_id.replace("/", "--")
        if not source.is_dir():
            raise OSError(f"no repository {repo_id}")
        snapshot = tmp_path / "snapshots" / repo_id.replace("/", "--")
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in sorted(source.iterdir()):
            if allow_patterns is None or any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snapshot / f.name)
                fetched.append(f.name)
        return str(snapshot)

    def hf_hub_download(repo_id, filename, **_):
        fetched.append(filename)
        return shutil.copy(remote / repo_id.replace("/", "--") / filename, tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    return remote, fetched


def test_the_check_before_launch_fetches_the_config_alone(served_hub):
    """Every rank runs the check before any process group exists: it asks the hub for
    config.json and nothing else; loading then fetches the weights once."""
    from megalite.train.init_from import check_init_from as check_before_launch

    remote, fetched = served_hub
    random_hf_gpt2(GPT2).save_pretrained(remote / "someone--tiny-gpt2")
    check_before_launch("someone/tiny-gpt2", GPT2)
    assert fetched == ["config.json"]
    fetched.clear()
    state = load_hf_state_dict("someone/tiny-gpt2", GPT2)
    assert "model.safetensors" in fetched and state


@pytest.mark.parametrize("check", ["before launch", "load"])
def test_a_wrong_shape_is_refused_before_any_weights_are_fetched(served_hub, check):
    from megalite.train.init_from import check_init_from as check_before_launch

    remote, fetched = served_hub
    random_hf_gpt2(GPT2).save_pretrained(remote / "someone--tiny-gpt2")
    wider = dataclasses.replace(GPT2, n_embd=64)
    with pytest.raises(ConfigError, match="n_embd"):
        (check_before_launch if check == "before launch" else load_hf_state_dict)(
            "someone/tiny-gpt2", wider)
    assert fetched and not [f for f in fetched if f.endswith(".safetensors")]
