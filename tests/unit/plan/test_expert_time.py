"""Expert parallelism in the time model and the search (`megalite.plan.expert_time`,
`megalite.plan.space`): where the folded EP group sits, the load-imbalance factor on the
expert compute and the exchange, the DP reductions without the experts, ep in the search and
in layout=auto, planner.moe_imbalance's refusal and megalite-plan's reading of a run's
logged imbalance."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megalite.cli.plan_moe import imbalance_from_run
from megalite.config.errors import ConfigError
from megalite.config.layout import Layout, validate
from megalite.config.schema import load_config
from megalite.model.families import family
from megalite.parallel.topology import group_ranks
from megalite.plan.devices import device_profile
from megalite.plan.expert_time import alltoall_s, expert_links, folded_groups
from megalite.plan.memory import make_plan
from megalite.plan.search import search
from megalite.plan.search_bounds import memory_lower_bound
from megalite.plan.space import apply_choice, candidates
from megalite.plan.stage_time import stage_forward_flops
from megalite.plan.time_model import predict
from megalite.plan.traffic import stage_traffic

H100 = device_profile("h100-80gb")
MIXTRAL = ["model=mixtral-8x22b", "tp=2", "pp=8", "train.seq_len=4096", "precision=bf16",
           "train.global_batch_size=256", "sp=true", "zero=1"]
TINY = ["model=mixtral-tiny", "device=cpu", "train.global_batch_size=8"]


def _predict(overrides, world, ep, per_node=8):
    cfg = load_config(overrides)
    lay = replace(Layout.from_config(cfg, world, "cuda"), ep_size=ep)
    return cfg, lay, predict(cfg, lay, stage_traffic(cfg, lay), H100, per_node)


def test_folded_groups_follow_the_topology_and_span_nodes():
    """tp2 pp8 dp8 ep8: an EP group takes 4 DP indices 16 ranks apart (4 nodes of 8); ep 2
    = tp 2 stays in a node; the groups cover each stage's ranks once."""
    groups = folded_groups(2, 1, 8, 8, 8)
    assert groups["ep"][0] == (0, 1, 16, 17, 32, 33, 48, 49)
    assert sorted(r for g in groups["ep"] for r in g) == list(range(128))
    assert sorted(r for g in groups["edp"] for r in g) == list(range(128))
    lay = Layout(tp_size=2, pp_size=8, dp_size=8, ep_size=8)
    assert expert_links(lay, H100, 8).ep_nodes == 4
    # the runtime's groups (`group_ranks`, what `Topology` makes its ep / edp groups of)
    for tp, cp, pp, dp, ep in [(2, 1, 8, 8, 8), (2, 2, 2, 2, 4), (1, 2, 4, 4, 8),
                               (2, 1, 8, 16, 32)]:
        runtime = group_ranks(tp, pp, dp, cp, ep)
        planned = folded_groups(tp, cp, pp, dp, ep)
        for kind in ("ep", "edp"):
            assert [list(g) for g in planned[kind]] == runtime[kind], (tp, cp, pp, dp, ep)
    assert not expert_links(replace(lay, ep_size=2), H100, 8).ep_crosses


def test_megatrons_rank_order_keeps_ep8_at_tp2_pp8_in_one_node():
    """parallel.rank_order=tp-cp-dp-pp: Mixtral's EP8 at TP2 PP8 DP8 on 8-GPU nodes is ranks
    0-7 (1 node; 4 under tp-cp-pp-dp), its DP group 2 nodes of 4 (8 of 1); the planned
    groups are the runtime's in either order."""
    lay = Layout(tp_size=2, pp_size=8, dp_size=8, ep_size=8, rank_order="tp-cp-dp-pp")
    assert folded_groups(2, 1, 8, 8, 8, "tp-cp-dp-pp")["ep"][0] == tuple(range(8))
    assert expert_links(lay, H100, 8).ep_nodes == 1
    assert expert_links(replace(lay, rank_order="tp-cp-pp-dp"), H100, 8).ep_nodes == 4
    for tp, cp, pp, dp, ep in [(2, 1, 8, 8, 8), (2, 2, 2, 2, 4), (1, 2, 4, 4, 8)]:
        runtime = group_ranks(tp, pp, dp, cp, ep, "tp-cp-dp-pp")
        planned = folded_groups(tp, cp, pp, dp, ep, "tp-cp-dp-pp")
        assert [list(g) for g in planned["ep"]] == runtime["ep"]
        assert [list(g) for g in planned["edp"]] == runtime["edp"]
    faster = _predict_order(MIXTRAL, 128, "tp-cp-dp-pp")
    assert faster.terms["ep"] < _predict_order(MIXTRAL, 128, "tp-cp-pp-dp").terms["ep"]


def _predict_order(overrides, world, order):
    cfg = load_config([*overrides, "ep=8", f"parallel.rank_order={order}"])
    lay = Layout.from_config(cfg, world, "cuda")
    return predict(cfg, lay, stage_traffic(cfg, lay), H100, 8)


def test_alltoall_time_inside_and_across_nodes():
    wire = 1e9
    inside = alltoall_s(wire, 0, 8, 1, H100)
    assert inside == pytest.approx(wire / (H100.intra_node.bus_gbps * 1e9))
    # 4 nodes of 2: 6 of the 7 peers off the node, on the rank's own rail
    assert alltoall_s(wire, 0, 8, 4, H100) == pytest.approx(
        6 / 7 * wire / (H100.inter_node.bus_gbps * 1e9))


def test_imbalance_scales_the_expert_compute_and_the_rows():
    """f = 1.5: the busiest EP rank's routed experts' matmuls half again (at the matmul
    rate) and its rows' exchange × 1.5; f = 1 adds nothing; ep 1 has none of these terms."""
    cfg, lay, base = _predict(MIXTRAL, 128, 8)
    assert base.terms["expert_imbalance"] == 0 and base.terms["ep"] > 0
    _, _, skew = _predict(MIXTRAL + ["planner.moe_imbalance=1.5"], 128, 8)
    m, blocks = 256 // 8, 7  # micro-batches, MoE blocks of a stage
    tokens = 4096 / 2  # a rank's tokens a micro-batch (tp 2)
    experts = 6 * 2 * 6144 * 16384  # 2 of 8 experts, 3·h·I each, 2 FLOPs a weight
    assert skew.terms["expert_imbalance"] == pytest.approx(
        0.5 * m * 3 * blocks * tokens * experts / H100.rate("bf16"))
    assert 1.3 * base.terms["ep"] < skew.terms["ep"] < 1.5 * base.terms["ep"]
    _, _, dense_ep = _predict(MIXTRAL, 128, 1)
    assert dense_ep.terms["ep"] == dense_ep.terms["edp"] == 0


def test_moe_imbalance_below_one_is_refused_by_key():
    with pytest.raises(ConfigError) as e:
        validate(load_config(TINY + ["planner.moe_imbalance=0.9"]), 1)
    assert e.value.key == "planner.moe_imbalance"


def test_search_tries_ep_and_layout_auto_may_choose_it():
    """ep 1, 2, 4 for 4 experts on 4 data-parallel ranks; held at ep=2 the search ranks ep 2
    layouts that validate; the memory bound stays under each ep layout's plan."""
    cfg = load_config(TINY)
    choices = candidates(cfg, 4, False)
    assert {c.ep for c in choices} == {1, 2, 4}
    for c in [c for c in choices if c.ep > 1 and c.tp == 1][:20]:
        planned = apply_choice(cfg, c)
        validate(planned, 4)
        plan = make_plan(planned, Layout.from_config(planned, 4, "cpu", False))
        assert memory_lower_bound(cfg, c, 4) <= plan.peak.bytes["total"]
    result = search(replace(cfg, layout="auto"), 2, device_profile("cpu"), 2, top=3,
                    fixed={"ep": 2})
    assert result.best and all(r.choice.ep == 2 and r.config.ep == 2 for r in result.best)
    assert "ep=2" in result.best[0].choice.overrides()
    # both rank orders where the order moves the EP groups (pp > 1, ep > tp·cp); one elsewhere
    orders = {(c.pp > 1 and c.ep > c.tp * c.cp, c.rank_order)
              for c in candidates(cfg, 8, False)}
    assert orders == {(True, "tp-cp-pp-dp"), (True, "tp-cp-dp-pp"), (False, "tp-cp-pp-dp")}


def test_imbalance_read_from_a_runs_logged_figures(tmp_path):
    """The mean over steps of the worst layer's imbalance; a run without MoE figures is
    refused naming the file."""
    rows = [{"step": 1, "moe": {"0": {"imbalance": 1.2}, "1": {"imbalance": 1.6}}},
            {"step": 2, "moe": {"0": {"imbalance": 1.4}, "1": {"imbalance": 1.3}}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert imbalance_from_run(tmp_path) == pytest.approx(1.5)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl: no MoE figures"):
        imbalance_from_run(tmp_path)


def test_each_stage_computes_its_own_blocks():
    """pp 2 of a 4-block mixtral-tiny whose first block keeps a dense MLP: stage 0 (the dense
    block and an MoE one) computes the dense MLP's 3·h·f weights where stage 1 (two MoE
    blocks) computes the router's E·h and k experts' 3·h·I, 2 FLOPs a weight a token."""
    cfg = load_config(TINY + ["pp=2", "model.moe.first_dense_layers=1"])
    flops = stage_forward_flops(cfg, Layout.from_config(cfg, 2, "cpu"))
    m = cfg.model
    h, f, moe = m.n_embd, m.ffn_size, m.moe
    dense_mlp, moe_mlp = 3 * h * f, moe.num_experts * h + moe.top_k * 3 * h * moe.expert_hidden(f)
    head = family(m).head_forward_flops_per_token(m)
    assert flops[0]["model"] - (flops[1]["model"] - head) == 2 * (dense_mlp - moe_mlp)
