"""Shared fixtures: a small prepared corpus (stdlib sources, trained tokenizer), made once."""
from pathlib import Path

import pytest

from megalite.config import DataConfig
from megalite.data.prepare import prepare


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """Token shards from 150 stdlib files with a 1024-token BPE (fits the tiny test models)."""
    out = tmp_path_factory.mktemp("data") / "stdlib"
    cfg = DataConfig(dir=str(out), max_documents=150, tokenizer_vocab_size=1024,
                     val_fraction=0.05, num_proc=1)
    prepare(cfg, out, progress=False)
    return out


# A model and batch small enough that 2-4 ranks train a few steps per second on 2 cores.
TINY = ["device=cpu", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.n_positions=64",
        "model.vocab_size=1024", "train.seq_len=32", "train.micro_batch_size=4",
        "train.global_batch_size=16", "train.eval_steps=2", "log.progress=false"]


def random_hf_gpt2(model_cfg, seed: int = 0):
    """A `transformers.GPT2LMHeadModel` of `model_cfg`'s shape in eval mode with every
    parameter random: a fresh one has zero biases and unit LayerNorms, under which a mapping
    that swaps LayerNorms or loses biases would still match."""
    import torch
    from transformers import GPT2LMHeadModel

    from megalite.model.hf import hf_config

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(hf_config(model_cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def shard_arrays(shards) -> list:
    """Every shard of a `TokenShards` as a read-only array (training reads windows through
    `TokenShards.samples` instead)."""
    import numpy as np

    return [np.fromfile(p, dtype=shards.dtype) for p in shards.paths]
