"""The planner on the schedules of the large runs: uneven stages (`parallel.edge_stage_layers`)
counted with each stage's own blocks and searched only where the split exists; interleaved
1F1B with m not a multiple of pp in the search space, its bubble the schedule's own."""
from __future__ import annotations

import pytest

from megalite.config.layout import Layout, validate
from megalite.config.schedule_rules import expected_bubble
from megalite.config.schema import load_config
from megalite.parallel.schedule import plan_rounds
from megalite.plan.devices import device_profile
from megalite.plan.memory import make_plan
from megalite.plan.space import apply_choice, candidates, chunk_blocks
from megalite.plan.time_model import predict

SMALL = ["device=cpu", "model.n_embd=64", "model.n_head=4", "model.n_positions=64",
         "model.vocab_size=1024", "train.seq_len=32", "model.resid_pdrop=0",
         "model.embd_pdrop=0", "model.attn_pdrop=0", "train.micro_batch_size=1"]


def test_search_space_takes_edge_stage_layers_where_it_splits():
    """8 blocks, edge 1 on 4 ranks: only pp·v slices that take the edge are tried (4 slices:
    1-3-3-1, 8 slices: one block each; not pp 1, which has no edge stage, nor pp 2 v 1, whose
    2 slices would hold 2 blocks), each valid, and the largest chunk counted is the split's
    (3 blocks of 4 slices; the balanced split's 2 before)."""
    cfg = load_config(SMALL + ["model.n_layer=8", "parallel.edge_stage_layers=1",
                               "train.global_batch_size=8"])
    space = candidates(cfg, 4, False)
    assert {(c.pp, c.virtual_stages, c.schedule) for c in space} == {
        (2, 2, "auto"), (2, 2, "zb-v"), (2, 4, "auto"), (4, 1, "auto"), (4, 1, "zb-h1"),
        (4, 2, "auto"), (4, 2, "zb-v")}
    for c in space:
        validate(apply_choice(cfg, c), 4)
    assert chunk_blocks(cfg, 2, 2) == chunk_blocks(cfg, 4, 1) == 3
    assert chunk_blocks(cfg, 4, 2) == 1


def test_stage_terms_count_each_stages_own_blocks():
    """pp 4 over 8 blocks: a middle stage of the 1-3-3-1 split computes 3/2 of the balanced
    split's (2 blocks each), the first stage less than the middle (1 block and the
    embeddings), and the memory plan holds 3 blocks' parameters on a middle stage."""
    over = SMALL + ["model.n_layer=8", "pp=4", "train.global_batch_size=8"]
    profile = device_profile("h100-80gb")

    def planned(extra):
        cfg = load_config(over + extra)
        validate(cfg, 4)
        layout = Layout.from_config(cfg, 4, "cuda")
        plan = make_plan(cfg, layout)
        return plan, predict(cfg, layout, plan.stages, profile, 8).stage_terms

    even_plan, even = planned([])
    edge_plan, edge = planned(["parallel.edge_stage_layers=1"])
    assert edge[1]["compute"] == pytest.approx(1.5 * even[1]["compute"], rel=1e-12)
    assert edge[0]["compute"] < edge[1]["compute"]
    block = (even_plan.stages[1].params + even_plan.stages[2].params) / 4
    assert edge_plan.stages[1].params == pytest.approx(3 * block, rel=1e-12)
    assert [s.layers for s in edge_plan.stages] == [1, 3, 3, 1]


@pytest.mark.parametrize("m", [3, 5])
def test_interleaved_with_any_m_is_searched_with_its_own_bubble(m):
    """pp 2 v 2 with m = 3 and 5 micro-batches is in the space (refused before: not a multiple
    of pp), and its bubble is the schedule's order's, (p - 1) / (v·m + p - 1)."""
    cfg = load_config(SMALL + ["model.n_layer=4", f"train.global_batch_size={m}"])
    space = candidates(cfg, 2, False)
    assert any(c.pp == 2 and c.virtual_stages == 2 and c.schedule == "auto" for c in space)
    rounds = plan_rounds(2, m, 2)
    length = max(r[-1].index for r in rounds) + 1
    assert 1 - 2 * 2 * m / length == pytest.approx(expected_bubble(2, m, 2))
