"""The search's time bound with ZeRO 1/2's parameter gather (`_first_gather_s`) and TP's own
latency: below every prediction, above the bound without them where they matter; and the
space leaving out what the launch refuses (overlap_param_gather's zero stages, MoE without
SP at tp > 1), EP searched as the launch takes it."""
from __future__ import annotations

from dataclasses import replace

import pytest

from megalite.config.errors import ConfigError
from megalite.config.layout import Layout, validate
from megalite.config.schema import load_config
from megalite.plan.devices import DeviceProfile, Link
from megalite.plan.links import NCCL_RING_BASE_S
from megalite.plan.search_bounds import TimeBound, smallest_latency, time_lower_bound
from megalite.plan.space import apply_choice, candidate_grids, candidates
from megalite.plan.time_model import predict
from megalite.plan.traffic import stage_traffic

SMALL = ["model.n_layer=4", "model.n_embd=64", "model.n_head=4", "model.n_positions=64",
         "model.vocab_size=1024", "train.seq_len=32", "model.resid_pdrop=0",
         "model.embd_pdrop=0", "model.attn_pdrop=0", "train.global_batch_size=16"]
# a slow all-gather: stage 0's gather outlasts its first forward at m >= 2
PROFILE = DeviceProfile.from_dict({
    "format": "megalite-device-profile", "version": 1, "name": "synthetic",
    "device": "synthetic accelerator", "memory_bytes": 2**40,
    "matmul_tflops": {"bf16": 1.0, "fp32": 1.0},
    "links": {"intra_node": {"bus_gbps": 10.0, "latency_s": 1e-6},
              "inter_node": {"bus_gbps": 2.5, "latency_s": 1e-5}},
    "gpus_per_node": 2, "sweep": [{"op": "all_reduce", "ranks": 2, "bytes": 1}]})
PROFILE = replace(PROFILE, hbm_gbps=100.0,
                  op_links={"intra_node": {"all_gather": Link(0.2, 1e-6)},
                            "inter_node": {"all_gather": Link(0.05, 1e-5)}})


def without_gather(bound: TimeBound, c) -> float:
    """The bound as it was before the gather term (no all-gather bus: infinite)."""
    buses = {k: v for k, v in bound.links(c).items() if k != "dp_all_gather"}
    return time_lower_bound(bound.cfg, c, bound.rate, {}, bound.e, buses["tp"], 1.0,
                            smallest_latency(bound.profile), buses, bound.per_block(c))


def test_the_gather_bound_stays_below_every_prediction_and_bites():
    """Every layout of 8 ranks (2 a node) under overlap_param_gather (without it the gather
    is exposed whole: `test_planner.py`'s brute force checks those bounds)."""
    cfg = load_config(SMALL + ["parallel.overlap_param_gather=true"])
    bound, bit = TimeBound.of(cfg, PROFILE, 2, None), 0
    for c in candidates(cfg, 8, False):
        cc = apply_choice(cfg, c)
        try:
            validate(cc, 8, 2)
        except ConfigError:
            continue
        layout = Layout.from_config(cc, 8, "cuda")
        step = predict(cc, layout, stage_traffic(cc, layout), PROFILE, 2).step_s
        assert bound(c) <= step * (1 + 1e-12), c
        bit += bound(c) > without_gather(bound, c) * 1.01
    assert bit > 500  # of 2,008 layouts, 668 (to 0.93 of the step, from 0.03)


def test_overlap_param_gather_leaves_its_refused_zero_stages_out_of_the_space():
    cfg = load_config(SMALL + ["parallel.overlap_param_gather=true"])
    assert {g.base[3] for g in candidate_grids(cfg, 8, False)} == {1, 2}
    assert {g.base[3] for g in candidate_grids(replace(
        cfg, parallel=replace(cfg.parallel, overlap_param_gather=False)), 8, False)} == \
        {0, 1, 2, 3}


def test_tp_latency_in_the_bound_is_the_tp_groups_own():
    """tp 4 on nodes of 2 crosses nodes: its collectives pay the inter-node link's ring step
    (NCCL's: the 10 µs 2-rank latency less its 8.4 µs base, over 2 steps: 0.8 µs; the
    intra-node link's is 0) in the prediction, and the bound charges at least that (4
    all-reduces a block, no SP)."""
    cfg = load_config(SMALL)
    bound = TimeBound.of(cfg, PROFILE, 2, None)
    c = next(c for c in candidates(cfg, 8, False) if (c.tp, c.pp, c.sp, c.micro_batch_size,
                                                      c.recompute) == (4, 1, False, 1, False))
    step = (1e-5 - NCCL_RING_BASE_S) / 2
    assert bound.links(c)["tp_latency"] == pytest.approx(step)
    m = cfg.train.global_batch_size // c.dp
    assert bound(c) >= m * cfg.model.n_layer * 4 * 3 * step


def test_moe_at_tp_over_1_is_searched_with_sp_only_and_ep_as_the_launch_takes_it():
    """The launch refuses sp=false with MoE at tp > 1: the space leaves it out rather than the
    validation one candidate at a time; ep > 1 is searched with every ZeRO stage and schedule
    the launch accepts (ZeRO 3 under ZB-H1 / ZB-V included)."""
    cfg = load_config(["model=mixtral-8x22b", "model.n_layer=4", "train.seq_len=64",
                       "train.global_batch_size=8", "precision=bf16"])
    out = candidates(cfg, 8, False)
    assert not [c for c in out if c.tp > 1 and not c.sp]
    assert any(c.tp > 1 and c.sp for c in out)
    zb3 = [c for c in out if c.ep > 1 and c.zero == 3 and c.zero_bubble]
    assert zb3
    validate(apply_choice(cfg, zb3[0]), 8, 8)  # the space follows the launch
    bad = replace(next(c for c in out if c.tp > 1), sp=False)
    with pytest.raises(ConfigError):  # still refused
        validate(apply_choice(cfg, bad), 8, 8)
