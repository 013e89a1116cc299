"""The pipeline's step simulated from the schedule's own order of operations
(megalite.plan.pipeline_sim) and the time model's bubble, pp and dp terms built on it."""
from __future__ import annotations

import pytest

from megalite.config.layout import Layout
from megalite.config.schedule_rules import expected_bubble
from megalite.config.schema import load_config
from megalite.plan.devices import device_profile
from megalite.plan.memory import make_plan
from megalite.plan.pipeline_sim import DpWindows, OpTimes, dp_windows, exposed_s, simulate
from megalite.plan.time_model import predict


def times(pp, v, f=1.0, b=2.0, w=0.0, heavy=None, factor=1.0):
    """Unit times per operation; stage `heavy` `factor` times slower."""
    def scale(x):
        return [[x * (factor if s == heavy else 1.0)] * v for s in range(pp)]
    return OpTimes(scale(f), scale(b), scale(w))


@pytest.mark.parametrize("pp, m, v, schedule, w", [
    (4, 8, 1, "1f1b", 0.0), (4, 4, 1, "1f1b", 0.0), (4, 8, 2, "interleaved", 0.0),
    (8, 16, 4, "interleaved", 0.0), (4, 8, 1, "zb-h1", 1.0), (4, 3, 1, "zb-h1", 1.0),
    (4, 8, 2, "zb-v", 1.0), (4, 4, 2, "zb-v", 1.0)])
def test_unit_times_give_the_schedules_formulas(pp, m, v, schedule, w):
    """With equal stages, unit times and no transfers the simulated idle share is the
    schedule's formula (expected_bubble): the simulation is the schedule, not a guess."""
    b = 1.0 if w else 2.0  # a split backward: B = W = F
    tl = simulate(pp, m, v, schedule, times(pp, v, 1.0, b, w))
    for busy in tl.busy:
        assert 1 - busy / tl.makespan == pytest.approx(expected_bubble(pp, m, v, schedule))


def test_one_micro_batch_chain_with_transfers():
    """pp = 2, m = 1: F0, send, F1, B1, send, B0 — the only order there is."""
    t = OpTimes([[1.0], [2.0]], [[3.0], [4.0]], [[0.0], [0.0]])
    hop = [[0.0, 0.5], [0.5, 0.0]]
    tl = simulate(2, 1, 1, "1f1b", t, hop)
    assert tl.makespan == pytest.approx(1 + 0.5 + 2 + 4 + 0.5 + 3)
    assert tl.first_forward[1][0] == (pytest.approx(1.5), 2.0)
    assert tl.last_backward[0][0] == pytest.approx(8.0)


def test_heavier_stage_paces_the_pipeline():
    """A stage 1.5x slower paces the step: the others idle while it works, and the formula
    on the heaviest stage (busy / (1 - beta)) over-charges it where the others are light."""
    pp, m = 4, 8
    tl = simulate(pp, m, 1, "1f1b", times(pp, 1, heavy=2, factor=1.5))
    heavy = tl.busy[2]
    assert tl.makespan > heavy
    assert tl.makespan < heavy / (1 - expected_bubble(pp, m))
    assert all(tl.makespan - b > tl.makespan - heavy for s, b in enumerate(tl.busy) if s != 2)


def test_interleaving_hides_earlier_chunks_reductions():
    """The gradient reduction of a chunk starts at its last backward: with v = 4 the earlier
    chunks' run under the later chunks' backwards and only the last chunk's quarter outlasts
    its last backward."""
    pp, m = 4, 8
    one = dp_windows(simulate(pp, m, 1, "1f1b", times(pp, 1)), 0, [1.0])
    four = dp_windows(simulate(pp, m, 4, "interleaved", times(pp, 4, 0.25, 0.5)), 0,
                      [0.25] * 4)
    total = 4.0
    assert exposed_s(total, one.reduce) == pytest.approx(total - 2.0)  # the last B's 2
    assert exposed_s(total, four.reduce) == pytest.approx(total / 4 - 0.5)
    assert exposed_s(10.0, four.reduce) == pytest.approx(10.0 - 6.5)  # from chunk 3's B on
    assert exposed_s(1.0, DpWindows.single(0.5, 2.0).gather) == pytest.approx(0.5)


def test_last_stage_gathers_under_its_idle_start():
    """ZeRO's gather before the first forward: the last stage waits pp - 1 forwards for its
    first input, so its gather hides there; stage 0's does not."""
    pp, m = 4, 8
    tl = simulate(pp, m, 1, "1f1b", times(pp, 1))
    assert exposed_s(3.5, dp_windows(tl, pp - 1, [1.0]).gather) == 0.0
    assert exposed_s(3.5, dp_windows(tl, 0, [1.0]).gather) == pytest.approx(2.5)


def _predict(extra, world=64):
    cfg = load_config(["model=gpt2-medium", "tp=2", "pp=4", "zero=1",
                       "train.micro_batch_size=1", "train.global_batch_size=64"] + extra)
    layout = Layout.from_config(cfg, world, "cuda")
    return predict(cfg, layout, make_plan(cfg, layout).stages, device_profile("h100-80gb"),
                   8)


def test_prediction_terms_come_from_the_simulation():
    """Every stage's busy + bubble + pp is the one simulated step; uneven stages
    (edge_stage_layers) leave the lighter edge stages more bubble than the middle ones, and
    interleaving shrinks the bubble."""
    busy = ("compute", "recompute", "non_matmul", "head_loss", "grad_accumulate", "tp", "cp",
            "offload")
    p = _predict(["parallel.edge_stage_layers=3"])
    pipe = {round(sum(s[k] for k in busy) + s["bubble"] + s["pp"], 9) for s in p.stage_terms}
    assert len(pipe) == 1
    assert p.stage_terms[0]["bubble"] > p.stage_terms[1]["bubble"] > 0
    assert p.stage_terms[0]["pp"] > 0
    v2 = _predict(["parallel.virtual_stages=2"])
    assert v2.stage_terms[1]["bubble"] < _predict([]).stage_terms[1]["bubble"]
