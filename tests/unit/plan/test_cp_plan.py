"""Context parallelism in the planner: a rank's activations at s/cp positions plus what CP
attention holds, ZeRO's shards and reductions over DP x CP, the cp traffic column, the CP
group's link, the cp time term (allgather exposed, the ring's sends hidden under its
compute), the search choosing cp when a sequence does not fit otherwise, and megalite-plan
showing it. Deterministic: no timing. (The wire bytes against the kernel's counters:
tests/integration/plan/test_cp_traffic.py.)"""
from __future__ import annotations

from dataclasses import replace

import pytest

from megalite.cli.plan import main as plan_main
from megalite.config.layout import Layout, validate
from megalite.config.schema import load_config
from megalite.model.families import family
from megalite.parallel.context_documents import block_mask_bytes
from megalite.plan import cp_terms
from megalite.plan.dims import dims
from megalite.plan.links import group_links
from megalite.plan.memory import make_plan
from megalite.plan.search import search
from megalite.plan.time_model import predict
from megalite.plan.traffic import stage_traffic
from megalite.plan.zero_table import model_state_bytes
from tests.unit.plan.test_planner import SMALL, synthetic

LLAMA = ["model=llama-tiny", "model.n_positions=256", "train.seq_len=64"]  # 4 q, 2 KV heads


def _layout(overrides, world):
    cfg = load_config(["train.micro_batch_size=1"] + overrides)
    validate(cfg, world, 8)
    return cfg, Layout.from_config(cfg, world, "cuda")


@pytest.mark.parametrize("model,comm", [(SMALL, "allgather"), (LLAMA, "allgather"),
                                        (LLAMA, "ring")])
def test_a_layers_activations_are_the_familys_at_s_over_cp_plus_cp_attentions(model, comm):
    cfg, lay = _layout(model + ["cp=2", f"parallel.cp_comm={comm}",
                                "train.global_batch_size=2"], 2)
    m, s, b, e = cfg.model, cfg.train.seq_len, cfg.train.micro_batch_size, 2
    hq, hk, d = m.n_head, m.kv_heads, m.n_embd // m.n_head
    local = family(m).layer_activation_bytes(m, s // 2, b, 1, False, e)
    extra = {"allgather": 2 * e * b * hk * d * s,  # the gathered K, V (the KV heads only)
             "ring": 4 * b * hq * d * s // 2}[comm]  # the fp32 merged output
    assert dims(cfg, lay).layer_act_full == local + extra
    assert dims(cfg, lay).s_rank == s // 2 and dims(cfg, lay).full == e * s // 2 * b * m.n_embd


def test_activations_fall_with_cp_and_zero_shards_over_dp_times_cp():
    base = LLAMA + ["zero=1", "train.global_batch_size=4", "train.seq_len=256"]
    peaks = {}
    for cp in (1, 2, 4):
        cfg, lay = _layout(base + [f"cp={cp}"], 4)
        plan = make_plan(cfg, lay)
        peaks[cp] = plan.peak.moments["loss backward"]["activations"]
        psi = plan.stages[0].params
        assert lay.grad_replicas == 4
        assert plan.stages[0].bytes["optimizer"] == model_state_bytes(lay, psi, 2)["optimizer"] \
            == 12 * psi / 4
    assert peaks[4] < peaks[2] < peaks[1]


def test_the_cp_column_is_the_kernels_bytes_and_dp_reduces_over_dp_times_cp():
    for comm, rec in (("allgather", "false"), ("ring", "true")):
        cfg, lay = _layout(LLAMA + ["cp=2", "tp=2", "zero=0", f"parallel.cp_comm={comm}",
                                    f"train.recompute={rec}", "train.global_batch_size=4"], 8)
        n, m = cfg.model.n_layer, lay.micro_batches(cfg.train.global_batch_size)
        traffic = stage_traffic(cfg, lay)[0]
        assert traffic.comm == make_plan(cfg, lay).stages[0].comm
        assert traffic.comm["cp"] == m * cp_terms.wire_bytes(cfg, lay, 2, n,
                                                             n if rec == "true" else 0) > 0
        replicas = lay.grad_replicas  # dp 2 x cp 2
        assert traffic.comm["dp"] == 2 * (replicas - 1) / replicas * 4 * traffic.params


def test_the_cp_group_stays_in_a_node_while_tp_times_cp_fits_one():
    profile = synthetic()
    inside = group_links(Layout(tp_size=2, cp_size=4, dp_size=2), profile, 8)
    across = group_links(Layout(tp_size=4, cp_size=4), profile, 8)
    assert not inside["cp"].crosses_nodes and inside["dp"].crosses_nodes
    assert across["cp"].crosses_nodes and across["cp_send"].crosses_nodes
    # a collective spans 2 rails a node; the ring's send one
    assert across["cp"].link.bus_gbps == 2 * across["cp_send"].link.bus_gbps


def _predicted(comm, profile, cp=2, extra=()):
    cfg, lay = _layout(LLAMA + [f"cp={cp}", f"parallel.cp_comm={comm}",
                                "train.global_batch_size=2", *extra], cp)
    return cfg, lay, predict(cfg, lay, make_plan(cfg, lay).stages, profile, 8)


def test_allgather_is_exposed_and_the_ring_hides_its_block_sends_under_compute():
    slow_link = synthetic(bus=1e-3)
    cfg, lay, gather = _predicted("allgather", slow_link)
    n, m, kv = cfg.model.n_layer, 2, cp_terms.kv_bytes(cfg, lay, 2)
    assert gather.terms["cp"] == pytest.approx(m * n * 2 * kv / 1e6, rel=1e-12)
    _, _, fast = _predicted("allgather", synthetic(bus=2e-3))
    assert fast.terms["cp"] == pytest.approx(gather.terms["cp"] / 2, rel=1e-12)
    # the ring on a link far slower than the compute: every send exposed (fp32 accumulators)
    _, _, ring = _predicted("ring", synthetic(bus=1e-3, tflops=1e6))
    assert ring.terms["cp"] == pytest.approx(m * n * (2 * kv + 2 * 2 * kv) / 1e6, rel=1e-9)
    # far faster: the block sends hide under the chunk pairs, the accumulators do not
    _, _, hidden = _predicted("ring", synthetic(bus=1e-3, tflops=1e-6))
    assert hidden.terms["cp"] == pytest.approx(m * n * 2 * 2 * kv / 1e6, rel=1e-12)


def test_a_ranks_compute_is_its_share_of_the_sequence():
    profile = synthetic(bus=1e9, tflops=1e-3)
    _, _, one = _predicted("allgather", profile, cp=1)
    _, _, two = _predicted("allgather", profile, cp=2)
    assert two.terms["compute"] == pytest.approx(one.terms["compute"] / 2, rel=1e-12)
    assert two.model_tflops_per_device == pytest.approx(one.model_tflops_per_device, rel=1e-2)


def test_the_search_chooses_cp_when_the_sequence_does_not_fit_otherwise():
    base = SMALL + ["model.n_positions=256", "train.seq_len=256", "train.global_batch_size=2",
                    "zero=3", "train.micro_batch_size=1"]
    peaks = {cp: make_plan(*_layout(base + [f"cp={cp}"], 2)).peak.bytes["total"]
             for cp in (1, 2)}
    assert peaks[2] < peaks[1]
    profile = replace(synthetic(), memory_bytes=int((peaks[1] + peaks[2]) / 2))
    fixed = {"tp": 1, "pp": 1, "zero": 3, "recompute": False, "micro_batch_size": 1}
    result = search(load_config(["train.micro_batch_size=1"] + base), 2, profile, 8, top=3,
                    fixed=fixed)
    assert {r.choice.cp for r in result.best} == {2}
    assert "cp=2" in result.best[0].choice.overrides()


def test_megalite_plan_shows_cp(capsys):
    plan_main(["--world-size", "4", "--device", "h100-80gb", *LLAMA, "cp=2",
               "train.micro_batch_size=1",
               "parallel.cp_comm=ring", "train.global_batch_size=4"])
    out = capsys.readouterr().out
    assert "cp=2 (ring)" in out and "cp GB" in out and "placement over DP x CP" in out
    assert " cp " in out.split("ms per step:")[1]


@pytest.mark.parametrize("comm", ["allgather", "ring"])
def test_under_the_document_mask_the_working_bytes_add_what_the_cp_kernels_hold(comm):
    """The spans' first positions (int64 a local token) and the allgather path's block mask
    (`block_mask_bytes`, what test_context_documents holds to a built mask's tensors) or the
    ring's chunk pair's mask and its complement; no [b, c, s] mask."""
    over = LLAMA + ["cp=2", f"parallel.cp_comm={comm}", "train.global_batch_size=2",
                    "train.seq_len=256", "train.micro_batch_size=2"]
    cfg, lay = _layout(over, 2)
    masked, _ = _layout(over + ["train.attention_mask=document"], 2)
    b, local = 2, 128
    held = block_mask_bytes(b, local, 256) if comm == "allgather" else 2 * b * 64 * 64
    assert cp_terms.document_bytes(masked, lay) == 8 * b * local + held
    for when in ("forward", "backward"):
        assert cp_terms.working_bytes(masked, lay, 2)[when] \
            == cp_terms.working_bytes(cfg, lay, 2)[when] + 8 * b * local + held
    assert cp_terms.document_bytes(masked, Layout()) == 0.0
