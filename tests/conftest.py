"""Shared fixtures (a small prepared corpus: stdlib sources, trained tokenizer, made once; the
serial references of the parity tests) and the rule that keeps the two tiers apart:
tests/unit holds no test marked `distributed` (nothing there spawns a rank or a process),
tests/integration only such tests (tests/README.md)."""
from pathlib import Path

import pytest

from megalite.config.schema import DataConfig
from megalite.data.prepare import prepare
from megalite.testing import spawn

pytest_plugins = ["tests.data_fixtures"]  # prepared corpora shared by both tiers

# Ranks are forked from a server that imported these once (megalite/testing/spawn.py); every
# rank of a distributed test imports its test module, hence pytest and the helpers, on top.
spawn.PRELOAD += [m for m in ("pytest", "tests.layouts") if m not in spawn.PRELOAD]
TIERS = {"unit": False, "integration": True}  # directory -> its tests spawn ranks or processes


def pytest_collection_modifyitems(items) -> None:
    """A test in the wrong tier stops the collection, naming it and the marker."""
    for item in items:
        tier = next((p.name for p in item.path.parents if p.parent.name == "tests"), None)
        spawns = item.get_closest_marker("distributed") is not None
        if tier in TIERS and spawns != TIERS[tier]:
            raise pytest.UsageError(
                f"{item.nodeid}: tests/{tier} holds "
                + ("no test that spawns ranks or processes (move it to tests/integration)"
                   if tier == "unit" else "only tests marked distributed (mark it, or move it "
                   "to tests/unit)"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """Token shards from 150 stdlib files with a 1024-token BPE (fits the tiny test models)."""
    out = tmp_path_factory.mktemp("data") / "stdlib"
    cfg = DataConfig(dir=str(out), max_documents=150, tokenizer_vocab_size=1024,
                     val_fraction=0.05, num_proc=1)
    prepare(cfg, out, progress=False)
    return out


def serial_common(tiny_data) -> list:
    """The runs compared with `serial_reference`: micro-batch 2, global batch 8."""
    return [f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8"]


@pytest.fixture(scope="session")
def serial_reference(tiny_data, tmp_path_factory) -> dict:
    """The serial run (10 fp32 steps of `serial_common`) that test_checkpoint,
    test_tensor_parallel and test_zero compare their layouts with, run once."""
    from tests.layouts import train_layout

    (result,) = train_layout(tmp_path_factory.mktemp("serial"), 1, serial_common(tiny_data))
    return result


PIPELINE_SERIAL_M = (1, 2, 4, 6, 8)  # micro-batches of the pipeline tests' pp=1 references
FP16_LEARNING = ["precision=fp16", "optim.lr=1e-2", "optim.warmup_steps=0"]
BF16_LEARNING = ["precision=bf16", "optim.lr=1e-2", "optim.warmup_steps=0"]
EIGHT_BLOCKS = ["model.n_layer=8"]  # room for an uneven `edge_stage_layers` split


def pipeline_layout(tiny_data, pp: int, tp: int, m: int, extra=()) -> list:
    """The pipeline tests' runs: 4 blocks, pp stages x tp ranks, one DP replica unless the
    world is larger, m micro-batches of one sequence."""
    return [f"data.dir={tiny_data}", "model.n_layer=4", "train.micro_batch_size=1",
            f"train.global_batch_size={m}", f"pp={pp}", f"tp={tp}", *extra]


@pytest.fixture(scope="session")
def pipeline_serial(tiny_data, tmp_path_factory) -> dict:
    """pp=1 references of the pipeline tests (test_pipeline, test_zero_bubble), in one
    launch: 10 fp32 steps for every m of PIPELINE_SERIAL_M, "fp16" and "bf16" (m = 2), and
    "n8" / "n8m8" (8 blocks, m = 4 / 8)."""
    from tests.layouts import train_layouts

    runs = [pipeline_layout(tiny_data, 1, 1, m) for m in PIPELINE_SERIAL_M] + \
        [pipeline_layout(tiny_data, 1, 1, 2, FP16_LEARNING),
         pipeline_layout(tiny_data, 1, 1, 2, BF16_LEARNING),
         pipeline_layout(tiny_data, 1, 1, 4, EIGHT_BLOCKS),
         pipeline_layout(tiny_data, 1, 1, 8, EIGHT_BLOCKS)]
    out = train_layouts(tmp_path_factory.mktemp("pipeline-serial"), 1, runs)
    return {key: r[0] for key, r in zip((*PIPELINE_SERIAL_M, "fp16", "bf16", "n8", "n8m8"), out)}


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

    from megalite.model.gpt2.hf import hf_config

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


def random_hf_llama(model_cfg, seed: int = 0):
    """A `transformers.LlamaForCausalLM` of `model_cfg`'s shape in eval mode with every
    parameter random (RMSNorm weights too: a fresh one has unit norms, under which a mapping
    that swaps the two norms of a block would still match)."""
    import torch
    from transformers import LlamaForCausalLM

    from megalite.model.llama.hf import hf_config

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config(model_cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model
