"""Expert parallelism's pure parts: the folded expert grid [EP, EDP] over each pipeline stage's
tp·cp·dp ranks (the picture of docs/parallelism.md for TP2 CP2 DP2 EP4), an expert weight's
EP shard and its place in the whole tensor, and `ep`'s refusals before launch by key."""
from __future__ import annotations

import itertools

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.parallel.param_spec import ParamSpec
from megalite.parallel.topology import coords_of, expert_coords, group_ranks


def test_folded_grid_of_tp2_cp2_dp2_ep4_is_the_documented_one():
    groups = group_ranks(tp=2, pp=1, dp=2, cp=2, ep=4)
    assert groups["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [expert_coords(r, 2, 1, 2, 4) for r in range(8)] == \
        [(r % 4, r // 4) for r in range(8)]


@pytest.mark.parametrize("tp,cp,pp,dp,ep", [(1, 1, 2, 4, 2), (2, 1, 2, 2, 4), (1, 2, 1, 4, 8),
                                            (2, 2, 3, 2, 2), (1, 1, 1, 4, 4)])
def test_expert_groups_fold_each_stage_with_the_same_pipeline_groups(tp, cp, pp, dp, ep):
    world, stage = tp * cp * pp * dp, tp * cp * dp
    groups = group_ranks(tp, pp, dp, cp, ep)
    for kind, size in (("ep", ep), ("edp", stage // ep)):
        assert sorted(itertools.chain(*groups[kind])) == list(range(world)), kind
        assert all(len(g) == size for g in groups[kind]), kind
        for g in groups[kind]:  # inside one pipeline stage
            assert len({coords_of(r, tp, pp, cp).pp_rank for r in g}) == 1
    for g in groups["ep"]:  # EP innermost: ep_rank 0..ep-1, one edp_rank
        coords = [expert_coords(r, tp, pp, cp, ep) for r in g]
        assert [c[0] for c in coords] == list(range(ep)) and len({c[1] for c in coords}) == 1
    for g in groups["pp"]:  # a pipeline line keeps its expert coordinates
        assert len({expert_coords(r, tp, pp, cp, ep) for r in g}) == 1


def test_an_expert_weight_is_split_on_dim_0_and_placed_in_the_whole_tensor():
    spec = ParamSpec("mlp.experts.down_proj", (4, 3, 2), expert=True)
    full = torch.arange(24.0).view(4, 3, 2)
    assert spec.local_shape(1, ep=2) == (2, 3, 2)
    for r in range(2):
        piece = spec.shard(full, 0, 1, ep_rank=r, ep=2)
        offset = spec.expert_offset(r, 2)
        assert torch.equal(piece.reshape(-1), full.reshape(-1)[offset:offset + 12])
    dense = ParamSpec("mlp.gate.weight", (4, 3))
    assert dense.local_shape(1, ep=2) == (4, 3) and dense.expert_offset(1, 2) == 0


MOE = ["model=mixtral-tiny", "device=cpu"]


@pytest.mark.parametrize("overrides, world, key", [
    (["ep=0"], 2, "ep"),
    (["ep=4", "model.moe.num_experts=6"], 4, "ep"),  # 6 experts
    (["ep=4"], 2, "ep"),  # 2 ranks
    (["model=llama-tiny", "ep=2"], 2, "ep"),
    (["ep=2", "fp8.recipe=rowwise", "fp8.emulate=true"], 2, "fp8.recipe"),
    (["ep=2", "parallel.ep_dispatch=ring"], 2, "parallel.ep_dispatch"),
    (["ep=2", "parallel.rank_order=tp-ep-dp-pp"], 2, "parallel.rank_order"),
    (["ep=2", "tp=2"], 4, "sp"),  # MoE under TP: its tokens split (sequence parallelism)
    (["ep=4", "pp=2"], 4, "ep")])  # 2 ranks a stage
def test_bad_ep_settings_are_refused_before_launch_by_key(overrides, world, key):
    cfg = load_config([*MOE, *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=world)
    assert e.value.key == key and "\n" not in str(e.value), str(e.value)


def test_ep_over_tensor_data_and_context_parallel_ranks_of_each_stage_is_accepted():
    for ep, world, zero, more in ((2, 2, 0, []), (4, 4, 1, []), (2, 4, 2, []), (2, 2, 3, []),
                                  (2, 4, 1, ["pp=2"]), (2, 4, 0, ["cp=2"]),
                                  (4, 8, 1, ["cp=2", "pp=2"]),
                                  (2, 4, 0, ["pp=2", "parallel.schedule=zb-v",
                                             "parallel.virtual_stages=2"]),
                                  (2, 4, 1, ["tp=2", "sp=true"]), (4, 4, 0, ["tp=2", "sp=true"]),
                                  (4, 8, 1, ["tp=2", "sp=true", "pp=2"]),
                                  (2, 4, 3, ["pp=2", "parallel.schedule=zb-h1", "model.n_layer=4"]),
                                  (2, 2, 1, ["resilience.rerun=on_nan"]),
                                  (2, 4, 1, ["cp=2", "fp8.recipe=tensorwise",
                                             "fp8.emulate=true"])):
        validate(load_config([*MOE, f"ep={ep}", f"zero={zero}", "train.global_batch_size=16",
                              "train.micro_batch_size=4", *more]), world_size=world)
