"""Simulated scale (megalite/cli/verify_rank.py): rank R of an N-rank layout built for real on the
fake process-group backend with tensors on meta, set next to the plan; every case inits and
destroys its own fake process group (`fake_world`), so they run in this one process."""
import itertools
import sys

import pytest
import torch
import torch.distributed as dist

from megalite.cli.verify_rank import main
from megalite.config.layout import Layout, validate
from megalite.config.schema import load_config
from megalite.parallel.topology import coords_of, group_ranks
from megalite.train.simulated import STATES, build_parts, fake_world, report, verify_rank

GPT2_XL = ["model=gpt2-xl", "pp=2", "zero=3", "train.seq_len=1024", "train.micro_batch_size=4",
           "train.global_batch_size=8192"]  # tp=1 pp=2 dp=2048 at N = 4,096
GPT_175B = ["model=gpt2-xl", "model.name=gpt-175b", "model.n_layer=96", "model.n_embd=12288",
            "model.n_head=96", "model.n_positions=2048", "tp=8", "pp=16", "sp=true", "zero=1",
            "train.seq_len=2048", "train.micro_batch_size=1",
            "train.global_batch_size=1536"]  # tp=8 pp=16 dp=32 at N = 4,096
LLAMA3_8B = ["model=llama3-8b", "tp=8", "pp=4", "sp=true", "zero=1", "train.seq_len=4096",
             "train.micro_batch_size=1", "train.global_batch_size=1024"]  # tp=8 pp=4 dp=128
# context parallelism: Megatron-Bridge's 8K recipe's cp 2 inside an 8-GPU node beside tp 8 (cp
# crosses nodes here), ZeRO-1 ranges over DP x CP = 128
LLAMA3_8B_CP = ["model=llama3-8b", "tp=8", "cp=2", "pp=4", "sp=true", "zero=1",
                "train.seq_len=8192", "train.micro_batch_size=1",
                "train.global_batch_size=512"]  # tp=8 cp=2 pp=4 dp=64
# tp=16 > n_kv_head=8: each KV head replicated over 2 TP ranks; zero 3, zero-bubble W
LLAMA32_1B_SHARED_KV = ["model=llama3.2-1b", "tp=16", "pp=2", "sp=true", "zero=3",
                        "parallel.schedule=zb-h1", "train.seq_len=2048",
                        "train.micro_batch_size=1", "train.global_batch_size=256"]
# expert parallelism: Mixtral 8x22B at ep 8 (EDP 128) and Qwen3-235B at ep 32 (EDP 128) folded
# over DP; Megatron-Core's Mixtral run's own layout, tp2 (SP) pp8 ep8, EP folded over a stage's
# TP and DP ranks (EDP 16); ZeRO-1 over EDP for the experts, over DP for the rest
MIXTRAL_8X22B_EP8 = ["model=mixtral-8x22b", "ep=8", "zero=1", "train.seq_len=4096",
                     "train.micro_batch_size=1", "train.global_batch_size=1024"]
MIXTRAL_8X22B_TP2_PP8_EP8 = ["model=mixtral-8x22b", "tp=2", "sp=true", "pp=8", "ep=8", "zero=1",
                             "train.seq_len=4096", "train.micro_batch_size=1",
                             "train.global_batch_size=1024"]
QWEN3_235B_EP32 = ["model=qwen3-235b-a22b", "ep=32", "zero=1", "train.seq_len=4096",
                   "train.micro_batch_size=1", "train.global_batch_size=4096"]
# the Megatron MoE model zoo's Qwen3-235B layout: tp2 (SP) pp8 vpp4 ep32, its 94 blocks in 32
# uneven chunks, EP folded over a stage's TP and DP ranks (EDP 4 at 1,024 ranks)
QWEN3_235B_TP2_PP8_VPP4_EP32 = ["model=qwen3-235b-a22b", "tp=2", "sp=true", "pp=8",
                                "parallel.virtual_stages=4", "ep=32", "zero=1",
                                "train.seq_len=4096", "train.micro_batch_size=1",
                                "train.global_batch_size=2048"]
# (world size, rank, overrides, device kind): zero 0-3, TP with SP, PP with virtual stages
# (interleaved), uneven edge stages, fp32 and bf16, up to N = 4,096. At N = 4,096 the ranks
# are not the last DP rank, whose ranges hold the buffers' padding (see the test below).
CASES = [
    (4, 3, ["model=gpt2", "zero=0", "train.micro_batch_size=1", "train.global_batch_size=8"],
     "cpu"),
    (16, 13, ["model=gpt2", "tp=2", "sp=true", "zero=1", "train.seq_len=1024",
              "train.micro_batch_size=1", "train.global_batch_size=8",
              "parallel.overlap_param_gather=true", "checkpoint.async_save=true"], "cuda"),
    (32, 17, ["model=gpt2-medium", "pp=2", "parallel.virtual_stages=2", "zero=2",
              "train.micro_batch_size=1", "train.global_batch_size=32"], "cuda"),
    (64, 63, ["model=gpt2", "tp=2", "pp=2", "sp=true", "zero=3", "train.seq_len=256",
              "train.micro_batch_size=1", "train.global_batch_size=16"], "cuda"),
    (256, 130, ["model=gpt2", "pp=4", "parallel.virtual_stages=3", "zero=1",
                "train.micro_batch_size=1", "train.global_batch_size=256"], "cpu"),
    (512, 511, ["model=gpt2-large", "tp=4", "pp=4", "parallel.edge_stage_layers=8", "zero=0",
                "train.micro_batch_size=1", "train.global_batch_size=32"], "cuda"),
    (4096, 4093, GPT2_XL, "cuda"),  # last stage, DP rank 2046
    (4096, 0, GPT2_XL, "cuda"),
    (4096, 0, GPT_175B, "cuda"),
    (4096, 4095, GPT_175B, "cuda"),
    (4096, 4095, LLAMA3_8B, "cuda"),
    (4096, 2111, LLAMA3_8B_CP, "cuda"),  # tp 7, cp 1, pp 3 (the last stage), dp 32
    (4096, 17, LLAMA32_1B_SHARED_KV, "cuda"),
    (1024, 1021, MIXTRAL_8X22B_EP8, "cuda"),  # ep rank 5, edp rank 127
    (1024, 1021, MIXTRAL_8X22B_TP2_PP8_EP8, "cuda"),  # a TP rank 1
    # Megatron's rank order (parallel.rank_order=tp-cp-dp-pp): rank 1021 is stage 7, dp 62
    (1024, 1021, MIXTRAL_8X22B_TP2_PP8_EP8 + ["parallel.rank_order=tp-cp-dp-pp"], "cuda"),
    (4096, 4000, QWEN3_235B_EP32, "cuda"),  # ep rank 0, edp rank 125
    (1024, 1021, QWEN3_235B_TP2_PP8_VPP4_EP32, "cuda"),  # TP rank 1, stage 6, last DP rank
]


def _layout(overrides, world, device="cuda"):
    cfg = load_config(overrides)
    validate(cfg, world, 8 if device == "cuda" else None)
    return cfg, Layout.from_config(cfg, world, device)


@pytest.mark.parametrize("world,rank,overrides,device", CASES,
                         ids=[f"N{c[0]}-r{c[1]}-{'-'.join(c[2][:3])}" for c in CASES])
def test_built_rank_matches_the_plan(world, rank, overrides, device):
    cfg, layout = _layout(overrides, world, device)
    result = verify_rank(cfg, layout, rank)
    assert not dist.is_initialized()  # torn down
    assert result.params["built"] == result.params["planned"]
    for _, state in STATES:
        assert result.ratio(state) == pytest.approx(1.0, abs=0.01), (state, result.table())
    c = coords_of(rank, layout.tp_size, layout.pp_size, layout.cp_size, layout.dp_size,
                  layout.rank_order)
    assert result.coords == {"tp": c.tp_rank, "cp": c.cp_rank, "pp": c.pp_rank,
                             "dp": c.dp_rank}
    assert result.groups["dp"] == layout.dp_size and result.groups["world"] == world


@pytest.mark.parametrize("world,overrides,ep", [(1024, MIXTRAL_8X22B_EP8, 8),
                                                (4096, QWEN3_235B_EP32, 32)])
def test_an_ep_rank_builds_its_share_of_the_experts_in_its_ep_and_edp_groups(world, overrides,
                                                                             ep):
    """At ep 8 of 1,024 ranks (and 32 of 4,096) the rank's groups are the folded grid's (ep
    ranks exchanging tokens, world/ep holding the same experts) and it holds E/ep experts: fewer
    parameters than the same rank at ep 1 by (1 - 1/ep) of the experts'."""
    cfg, layout = _layout(overrides, world)
    result = verify_rank(cfg, layout, world - 1)
    assert result.groups["ep"] == ep and result.groups["edp"] == world // ep, result.groups
    dense_cfg, dense = _layout([o for o in overrides if not o.startswith("ep=")], world)
    whole = verify_rank(dense_cfg, dense, world - 1).params["built"]
    m = cfg.model
    experts = m.n_layer * m.moe.num_experts * 3 * m.n_embd * (m.moe.expert_size or m.n_inner)
    assert whole - result.params["built"] == experts - experts // ep


def test_last_dp_rank_holds_the_padding_without_moments():
    """The flat buffers' padding (< N elements per bucket) sits at their ends, in the last DP
    rank's ranges: master weights, no AdamW moments. At dp = 2048 with 26 ZeRO-3 units that is
    7% of that rank's O below the plan's 12Ψ/N, and exactly 8 bytes per padding element."""
    cfg, layout = _layout(GPT2_XL, 4096)
    result = verify_rank(cfg, layout, 4095)
    assert result.coords == {"tp": 0, "cp": 0, "pp": 1, "dp": 2047} and result.padding > 0
    assert result.ratio("params") == pytest.approx(1.0, abs=0.01)
    assert result.ratio("grads") == pytest.approx(1.0, abs=0.01)
    shard_elements = result.built["params"] // 2  # bf16 parameters: this rank's ranges
    assert result.built["optimizer"] == 4 * shard_elements + 8 * (shard_elements - result.padding)
    assert result.built["optimizer"] < result.planned["optimizer"]
    assert "padding elements" in result.table()


@pytest.mark.parametrize("tp,pp,dp", [(1, 2, 2048), (8, 16, 32)])
def test_groups_at_4096_ranks_partition_the_world(tp, pp, dp):
    world = 4096
    kinds = group_ranks(tp, pp, dp)
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dp), ("mp", tp * pp)):
        assert all(len(g) == size for g in kinds[kind]), kind
        members = list(itertools.chain(*kinds[kind]))
        assert len(members) == world and set(members) == set(range(world)), kind  # disjoint
    edges = [r for r in range(world) if coords_of(r, tp, pp).pp_rank in (0, pp - 1)]
    members = list(itertools.chain(*kinds["embedding"]))
    assert all(len(g) == 2 for g in kinds["embedding"])
    assert len(members) == len(set(members)) and sorted(members) == edges


@pytest.mark.parametrize("tp,pp,dp,rank", [(1, 2, 2048, 4095), (8, 16, 32, 1000)])
def test_built_topology_holds_real_fake_backend_groups(tp, pp, dp, rank):
    overrides = GPT2_XL if tp == 1 else GPT_175B
    cfg, layout = _layout(overrides, tp * pp * dp)
    assert (layout.tp_size, layout.pp_size, layout.dp_size) == (tp, pp, dp)
    kinds = group_ranks(tp, pp, dp)
    with fake_world(rank, layout.world_size):
        topo, model, engine, _ = build_parts(cfg, layout)
        for kind, group in topo.groups.items():
            if kind in ("world", "checkpoint"):
                continue
            assert group.ranks in kinds[kind] and group.ranks[group.rank] == rank, kind
            if group.size > 1:
                assert (group.pg.size(), group.pg.rank()) == (group.size, group.rank), kind
                assert dist.get_backend(group.pg) == "fake"
        on_edge = topo.coords.pp_rank in (0, pp - 1)
        assert ("embedding" in topo.groups) == on_edge
        _assert_all_on_meta(model, engine)


def _assert_all_on_meta(model, engine):
    """No tensor of the build has storage: parameters, flat buffers, master and AdamW pieces."""
    tensors = list(model.parameters())
    for b in engine.buckets:
        tensors += [b.param_full, b.param_region, b.main, b.main_grad]
        tensors += [b.grad_full] if b.grad_full is not None else []
    for group in engine.optimizer.param_groups:
        tensors += [p for p in group["params"]] + [p.grad for p in group["params"]]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert not engine.optimizer.state  # moments are counted, not allocated


def test_zero3_build_stays_on_meta_and_reports_after_teardown():
    cfg, layout = _layout(CASES[3][2], 64)
    with fake_world(5, 64):
        parts = build_parts(cfg, layout)
        _assert_all_on_meta(parts[1], parts[2])
        result = report(cfg, layout, *parts)
    assert not dist.is_initialized() and result.as_dict()["bytes"]["P"]["built"] > 0


def test_fake_world_refuses_a_second_process_group():
    with fake_world(0, 2):
        with pytest.raises(RuntimeError, match="fresh process"):
            with fake_world(1, 2):
                pass
    assert not dist.is_initialized()


def _main_error(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("rank", [4096, -1])
def test_rank_outside_the_world_is_refused(capsys, rank):
    code, err = _main_error(capsys, ["--verify-rank", str(rank), "--world-size", "4096",
                                     *GPT2_XL])
    assert code == 2 and f"--verify-rank={rank}" in err and "[0, --world-size=4096)" in err


def test_invalid_layout_names_the_key(capsys):
    code, err = _main_error(capsys, ["--verify-rank", "0", "--world-size", "4096", "model=gpt2",
                                     "tp=8", "pp=3"])
    assert code == 2 and "bad configuration: tp*cp*pp=24" in err and "4096" in err
    code, err = _main_error(capsys, ["--verify-rank", "0", "--world-size", "4096",
                                     *GPT2_XL[:-1], "train.global_batch_size=1000"])
    assert code == 2 and "train.global_batch_size=1000" in err and "8192" in err


def test_missing_fake_backend_names_the_torch_versions(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)
    code, err = _main_error(capsys, ["--verify-rank", "0", "--world-size", "2", "model=gpt2",
                                     "train.global_batch_size=16"])
    assert code == 1 and "torch >= 2.1" in err and torch.__version__ in err
    assert not dist.is_initialized()
