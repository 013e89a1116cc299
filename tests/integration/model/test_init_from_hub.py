"""init_from a hub id: the first rank of a node loads (downloads) first, the node's other ranks
read the cache after it, so a node downloads the model once, not once per rank at the same
time. The hub is simulated inside the ranks (no network): the hub loader is patched to read a
local save_pretrained directory and to record when each rank called it."""
from __future__ import annotations

import time

import pytest

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY, random_hf_gpt2
from tests.layouts import FP32_NO_DROPOUT


def _from_hub(rank, world, tiny_data, run_dir, local_copy):
    from megalite.model import hf_io

    calls, load = [], hf_io.load_hf_state_dict

    def hub(source, cfg):
        assert source == "someone/tiny-gpt2", source  # a hub id: no such local path
        start = time.monotonic()
        time.sleep(0.5)  # the download
        state = load(local_copy, cfg)
        calls.append((start, time.monotonic()))
        return state

    hf_io.load_hf_state_dict = hub
    cfg = load_config(TINY + FP32_NO_DROPOUT + [f"data.dir={tiny_data}", "zero=1",
                                                "init_from=someone/tiny-gpt2"])
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    wte = trainer.model.chunks[0].transformer.wte.weight.detach()[:5].clone()
    return calls, wte


@pytest.mark.distributed
def test_hub_weights_load_on_the_first_rank_of_a_node_first(tiny_data, tmp_path):
    cfg = load_config(TINY).model
    model = random_hf_gpt2(cfg)
    model.save_pretrained(tmp_path / "hub")
    (c0, w0), (c1, w1) = run_ranks(_from_hub, 2, args=(tiny_data, str(tmp_path / "run"),
                                                          str(tmp_path / "hub")), timeout_s=300)
    assert len(c0) == len(c1) == 1
    assert c1[0][0] >= c0[0][1]  # local rank 1 started after local rank 0 had the weights
    assert (w0 == w1).all() and (w0 == model.transformer.wte.weight[:5]).all()
