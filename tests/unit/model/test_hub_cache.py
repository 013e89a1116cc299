"""init_from a hub id through huggingface_hub's cache, offline: a cache built here in the hub's
layout (models--<org>--<name>/snapshots/<commit>, refs/main), HF_HUB_OFFLINE=1, no network.
Both families load with the weights saved (a Llama in safetensors shards with their index);
a model not in the cache is one line naming the id and the cache."""
from __future__ import annotations

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
