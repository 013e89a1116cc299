"""The placement planner (megalite/plan/memory.py) against what runs measure: parameters per rank,
model-state bytes and every group's wire bytes per step from real gloo runs, activation bytes
from the tensors autograd saves. Three of the 8-rank runs also score HellaSwag, against the
serial run (tests/unit/test_hellaswag.py)."""
from __future__ import annotations

import pytest
import torch

from megalite.bench.tensor import saved_activation_bytes
from megalite.config.layout import Layout
from megalite.config.schema import load_config
from megalite.model.gpt2 import GPT2
from megalite.model.init import init_parameters
from megalite.plan.memory import make_plan
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT


@pytest.mark.parametrize("recompute", [[], ["train.recompute=true"],
                                       ["train.recompute=true", "train.recompute_layers=1"]])
def test_activation_estimate_matches_saved_tensors(recompute):
    cfg = load_config(TINY + FP32_NO_DROPOUT + recompute)
    stage = make_plan(cfg, Layout.from_config(cfg, 1, "cpu")).stages[0]
    model = GPT2(cfg.model, recompute=cfg.train.recompute,
                 recompute_layers=cfg.train.recompute_layers).train()
    init_parameters(model, seed=0)
    s, b = cfg.train.seq_len, cfg.train.micro_batch_size
    w = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    saved = saved_activation_bytes(lambda: model(w[:, :-1], w[:, 1:]), list(model.parameters()))
    want = stage.bytes["activations"]
    if recompute:  # the layer being re-run in backward is not alive during the forward
        from megalite.plan.dims import layer_activation_bytes
        want -= layer_activation_bytes(s, b, cfg.model.n_embd, cfg.model.n_head, 1, False, 4)
    assert saved == pytest.approx(want, rel=0.01)


@pytest.mark.parametrize("overrides", [["pp=2"], ["tp=2", "pp=2", "parallel.virtual_stages=2",
                                                  "model.n_layer=4"],
                                       ["pp=2", "parallel.schedule=zb-v", "model.n_layer=4",
                                        "parallel.virtual_stages=2"],
                                       []])
def test_the_plans_parameter_list_is_the_models(overrides):
    """The plan buckets gradients as the engine does, from its own list of each chunk's
    parameter sizes in registration order: that list is the model's."""
    from megalite.config.stage_partition import stage_chunks
    from megalite.model.stage import build_stage
    from megalite.parallel.group import single_rank_group
    from megalite.plan.chunks import stage_ends
    from megalite.plan.dims import dims
    from megalite.plan.zero_table import chunk_param_sizes

    cfg = load_config(TINY + overrides)
    layout = Layout.from_config(cfg, cfg.tp * cfg.pp, "cpu")
    tp_group = single_rank_group("tp")
    tp_group.ranks = list(range(cfg.tp))  # the sizes of TP rank 0's slices
    for k, blocks in enumerate(stage_chunks(cfg.model.n_layer, cfg.pp, layout.virtual_stages,
                                            v_shape=layout.v_shape)):
        stage = build_stage(cfg.model, blocks, k, cfg.pp, layout.v_shape, tp_group=tp_group)
        seen = set()  # zb-v: stage 0's LM head is its embedding, bucketed once (the engine)
        for c, (chunk, e) in enumerate(zip(stage.chunks, stage_ends(layout.placement, k))):
            want = [(p.numel(), chunk.param_specs[n].tied) for n, p in chunk.named_parameters()
                    if id(p) not in seen]
            seen.update(id(p) for p in chunk.parameters())
            got = chunk_param_sizes(dims(cfg, layout), e.first, e.last, len(blocks[c]),
                                    e.head_copy, e.tied)
            assert [(size, tied) for _, size, tied in got] == want, (overrides, k, c)
