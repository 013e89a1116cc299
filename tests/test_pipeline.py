"""1F1B pipeline parallelism: the schedule's order, stage partition, and training equal to
pp=1 on real gloo ranks (with tensor parallelism, m < pp, m = pp and m > pp)."""
from __future__ import annotations

import itertools

import pytest
import torch

from megalite.parallel.pipeline import (Event, StepTrace, expected_bubble, partition_layers,
                                        schedule_1f1b)
from tests.layouts import assert_equal, train_layout, train_layouts


def _simulate_1f1b(pp: int, m: int):
    """Independent reference: event-driven simulation of PipeDream-Flush with unit-time F and
    B. A stage runs a backward whenever one is ready (gradient arrived), else a forward if
    fewer than pp - stage micro-batches are in flight and its input arrived."""
    done_f = [[None] * m for _ in range(pp)]  # time each F finished
    done_b = [[None] * m for _ in range(pp)]
    orders = [[] for _ in range(pp)]
    nf, nb, t = [0] * pp, [0] * pp, 0
    while any(nb[s] < m for s in range(pp)):
        ops = []
        for s in range(pp):
            i = nb[s]
            can_b = i < nf[s] and (s == pp - 1 or (done_b[s + 1][i] is not None
                                                    and done_b[s + 1][i] <= t))
            j = nf[s]
            can_f = j < m and nf[s] - nb[s] < pp - s and (
                s == 0 or (done_f[s - 1][j] is not None and done_f[s - 1][j] <= t))
            if can_b:
                ops.append((s, "B", i))
            elif can_f:
                ops.append((s, "F", j))
        for s, kind, i in ops:
            orders[s].append((kind, i))
            if kind == "F":
                done_f[s][i], nf[s] = t + 1, nf[s] + 1
            else:
                done_b[s][i], nb[s] = t + 1, nb[s] + 1
        t += 1
    return orders


@pytest.mark.parametrize("pp,m", list(itertools.product([1, 2, 3, 4, 6], [1, 2, 3, 4, 5, 8])))
def test_schedule_is_1f1b(pp, m):
    reference = _simulate_1f1b(pp, m)
    for stage in range(pp):
        order = schedule_1f1b(pp, stage, m)
        assert order == reference[stage], (stage, order, reference[stage])
        warmup = min(pp - stage - 1, m)
        assert order[:warmup] == [("F", i) for i in range(warmup)]
        in_flight, most = 0, 0
        for kind, _ in order:
            in_flight += 1 if kind == "F" else -1
            most = max(most, in_flight)
        assert most <= pp - stage and in_flight == 0


def test_partition_is_contiguous_and_balanced():
    assert partition_layers(12, 1) == [range(0, 12)]
    assert partition_layers(12, 4) == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    # the remainder goes to the middle stages first (the edges hold embedding and head)
    assert [len(r) for r in partition_layers(14, 4)] == [3, 4, 4, 3]
    assert [len(r) for r in partition_layers(48, 5)] == [9, 10, 10, 10, 9]
    # an explicit, smaller edge
    assert [len(r) for r in partition_layers(12, 4, edge_stage_layers=2)] == [2, 4, 4, 2]
    assert [len(r) for r in partition_layers(13, 5, edge_stage_layers=2)] == [2, 3, 3, 3, 2]
    with pytest.raises(ValueError, match="pp=5"):
        partition_layers(4, 5)
    with pytest.raises(ValueError, match="edge_stage_layers=3"):
        partition_layers(6, 3, edge_stage_layers=3)


def test_bubble_of_a_trace():
    trace = StepTrace([Event("F", 0, 0.0, 1.0), Event("B", 0, 3.0, 5.0)], wall=6.0)
    assert trace.busy == 3.0 and trace.bubble == 0.5
    assert expected_bubble(4, 4) == pytest.approx(3 / 7)


def _layout(tiny_data, pp, tp, m, extra=()):
    """pp stages x tp ranks, one DP replica, m micro-batches of one sequence."""
    return [f"data.dir={tiny_data}", "model.n_layer=4", "train.micro_batch_size=1",
            f"train.global_batch_size={m}", f"pp={pp}", f"tp={tp}", *extra]


@pytest.fixture(scope="module")
def serial_runs(tiny_data, tmp_path_factory):
    """pp=1 references for every global batch the tests use."""
    ms = (1, 2, 4, 6)
    runs = train_layouts(tmp_path_factory.mktemp("serial"), 1,
                         [_layout(tiny_data, 1, 1, m) for m in ms])
    return {m: r[0] for m, r in zip(ms, runs)}


def _check(serial, ranks, pp):
    assert_equal(serial, ranks)
    for res in ranks:
        stage = res["coords"][1]
        assert max(res["max_live"]) <= pp - stage, (stage, res["max_live"])


@pytest.mark.parametrize("pp,tp,ms", [
    (2, 1, (1, 6)),  # m < pp, m > pp
    (2, 2, (2,)),  # m = pp
    (4, 1, (4, 2)),  # m = pp, m < pp
    (4, 2, (6,)),  # m > pp, 8 ranks
])
def test_training_equals_pp1(tiny_data, tmp_path, serial_runs, pp, tp, ms):
    """10 optimizer steps (fp32, dropout 0): losses, grad norms, validation loss and every
    parameter slice after every step equal the pp=1 run within 1e-5 relative; activations of
    at most pp - stage micro-batches alive at once on each stage."""
    runs = train_layouts(tmp_path, pp * tp, [_layout(tiny_data, pp, tp, m) for m in ms])
    for m, ranks in zip(ms, runs):
        _check(serial_runs[m], ranks, pp)


def test_tied_embedding_copies_stay_identical(tiny_data, tmp_path, serial_runs):
    """The first stage's token embedding and the last stage's LM-head copy start equal, get
    the same (summed) gradient and stay equal, step after step; with sequence parallelism and
    uneven stages too."""
    ranks = train_layout(tmp_path, 4, _layout(tiny_data, 2, 2, 4, ["sp=true"]))
    _check(serial_runs[4], ranks, 2)
    by_coords = {r["coords"]: r for r in ranks}
    for tp_rank in range(2):
        first, last = by_coords[(tp_rank, 0, 0)], by_coords[(tp_rank, 1, 0)]
        for step in range(len(first["params"])):
            assert torch.equal(first["params"][step]["transformer.wte.weight"],
                               last["params"][step]["lm_head.weight"])


def test_edge_stages_with_fewer_blocks(tiny_data, tmp_path, serial_runs):
    ranks = train_layout(tmp_path, 3, _layout(tiny_data, 3, 1, 4,
                                              ["parallel.edge_stage_layers=1"]))
    _check(serial_runs[4], ranks, 3)
    blocks = {r["coords"][1]: sorted({n.split(".")[2] for n in r["specs"]
                                      if n.startswith("transformer.h.")}) for r in ranks}
    assert blocks == {0: ["0"], 1: ["1", "2"], 2: ["3"]}
