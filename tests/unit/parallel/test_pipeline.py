"""Pipeline parallelism: the 1F1B and interleaved schedules' orders and rounds, stage
partition, and training equal to pp=1 on real gloo ranks (with tensor parallelism, m < pp,
m = pp and m > pp; interleaved with TP + SP, ZeRO 1 and 3)."""
from __future__ import annotations

import itertools

import pytest

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schedule_rules import expected_bubble
from megalite.config.schema import load_config
from megalite.config.stage_partition import ChunkPlacement, partition_layers, stage_chunks
from megalite.parallel.pipeline import Event, StepTrace
from megalite.parallel.schedule import (
    Op,
    OpKind,
    input_source,
    interleaved_table,
    max_in_flight,
    peak_live_bytes,
    plan_rounds,
    stage_order,
)


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
        order = [(op.kind, op.micro_batch) for op in stage_order(pp, stage, m)]
        assert order == reference[stage], (stage, order, reference[stage])
        warmup = min(pp - stage - 1, m)
        assert order[:warmup] == [("F", i) for i in range(warmup)]
        assert max_in_flight(pp, stage, m) == min(pp - stage, m)


def test_interleaved_order_is_megatrons():
    """pp=2, v=2, m=4 (Megatron's get_model_chunk_id / warmup count): forwards go through the
    micro-batches in groups of pp per chunk, backwards with the chunks reversed."""
    f = [Op("F", c, i) for c, i in [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]]
    b = [Op("B", c, i) for c, i in [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]]
    # stage 0: warmup (2-0-1)*2 + (2-1)*2 = 4 forwards; stage 1: 2
    assert stage_order(2, 0, 4, 2) == f[:4] + [f[4], b[0], f[5], b[1], f[6], b[2], f[7], b[3]] \
        + b[4:]
    assert stage_order(2, 1, 4, 2) == f[:2] + [x for k in range(6) for x in (f[2 + k], b[k])] \
        + b[6:]
    with pytest.raises(ValueError, match="m >= pp"):
        stage_order(2, 0, 1, 2)


def test_interleaved_groups_take_any_m():
    """m not a multiple of pp (Llama 3's flexible schedule): groups of pp micro-batches, the
    last one taking the rest, so every group holds at least pp."""
    assert interleaved_table(2, 3, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert interleaved_table(2, 5, 2) == [(0, 0), (1, 0), (0, 1), (1, 1),
                                          (2, 0), (3, 0), (4, 0), (2, 1), (3, 1), (4, 1)]
    assert interleaved_table(3, 8, 2)[6:] == [(i, c) for c in range(2) for i in range(3, 8)]
    assert interleaved_table(4, 4, 3) == [(i, c) for c in range(3) for i in range(4)]
    for m in range(1, 8):  # a forward-only pass (evaluation) runs any m, also m < pp
        rounds = plan_rounds(3, m, 2, True)
        for stage in rounds:
            assert sorted((r.op for r in stage if r.op), key=repr) == \
                sorted((Op(OpKind.FORWARD, c, i) for c in range(2) for i in range(m)), key=repr)


@pytest.mark.parametrize("pp,v", [(2, 1), (2, 2), (2, 3), (3, 2), (4, 1), (4, 2), (4, 4), (8, 2)])
def test_rounds_match_and_bubble_follows_the_formula(pp, v):
    """Every operation runs once, after its input arrived; every transfer is one stage's send
    and its consumer's receive in the same round; the simulated idle fraction is
    (p-1)/(v·m+p-1) and at most (p-s-1)·2 + (v-1)·p + 1 chunk activations are alive (Megatron's
    warmup + 1)."""
    for m in (pp, pp + 1, 2 * pp, 2 * pp + 1, 3 * pp - 1) if v > 1 else \
            (1, pp - 1 or 1, pp, 2 * pp + 1):
        rounds = plan_rounds(pp, m, v)
        arrived, sent, received = [set() for _ in range(pp)], [], []
        for index in range(max(r[-1].index for r in rounds) + 1):
            for s in range(pp):
                rnd = next((r for r in rounds[s] if r.index == index), None)
                if rnd is None:
                    continue
                op = rnd.op
                if op is not None:
                    virtual = op.chunk * pp + s
                    needs_input = (op.kind == "F" and virtual > 0) or \
                        (op.kind == "B" and virtual < pp * v - 1)
                    if needs_input:
                        assert (op.kind, op.chunk, op.micro_batch) in arrived[s], (s, op)
                sent += [(index, t) for t in rnd.sends]
                received += [(index, t) for t in rnd.recvs]
                assert all(t.src == s for t in rnd.sends) and all(t.dst == s for t in rnd.recvs)
            for i, t in received:
                if i == index:
                    arrived[t.dst].add((t.kind, t.chunk, t.micro_batch))
        assert sorted(sent, key=repr) == sorted(received, key=repr)
        for s in range(pp):
            ops = [r.op for r in rounds[s] if r.op is not None]
            assert sorted(ops, key=repr) == sorted(
                (Op(k, c, i) for k in (OpKind.FORWARD, OpKind.BACKWARD) for c in range(v)
                 for i in range(m)), key=repr)
            assert ops == stage_order(pp, s, m, v)
            forwarded = set()  # every backward after its forward (the loss's chunk too)
            for op in ops:
                assert op.kind == "F" or (op.chunk, op.micro_batch) in forwarded, (s, op)
                forwarded.add((op.chunk, op.micro_batch))
            group = pp if m % pp == 0 else (m if m < 2 * pp else pp + m % pp)
            limit = min(pp - s, m) if v == 1 else \
                min((pp - s - 1) * 2 + (v - 1) * group + 1, m * v)
            assert max_in_flight(pp, s, m, v) == limit
        length = max(r[-1].index for r in rounds) + 1  # in forward/backward time units
        assert 1 - 2 * m * v / length == pytest.approx(expected_bubble(pp, m, v))


@pytest.mark.parametrize("pp,m,v,schedule", [(2, 5, 2, "auto"), (3, 4, 2, "auto"),
                                               (4, 6, 1, "zb-h1"), (2, 5, 2, "zb-v")])
def test_order_and_input_sources_are_the_schedules_graph(pp, m, v, schedule):
    """A planner's view (docs/pipelines.md): each stage's `stage_order` and each operation's
    `input_source` give a graph whose as-soon-as-possible unit-time schedule ends when the
    executor's rounds do, stage by stage (any weights per stage give the timed version)."""
    placement = ChunkPlacement(pp, v, v_shape=schedule == "zb-v")
    orders = [stage_order(pp, s, m, v, schedule) for s in range(pp)]
    done, end = {}, [0] * pp
    while len(done) < sum(map(len, orders)):
        for s in range(pp):
            for op in orders[s][len([k for k in done if k[0] == s]):]:
                src = input_source(op.kind, s, op.chunk, placement)
                key = None if src is None else (src[0], op.kind, src[1], op.micro_batch)
                if key is not None and key not in done:
                    break
                end[s] = max(end[s], done.get(key, 0)) + 1
                done[(s, op.kind, op.chunk, op.micro_batch)] = end[s]
    rounds = plan_rounds(pp, m, v, False, schedule)
    assert end == [1 + max(r.index for r in rounds[s] if r.op is not None) for s in range(pp)]


def test_peak_live_bytes_weights_the_chunks():
    assert peak_live_bytes(2, 0, 4, 2, [1.0, 1.0]) == max_in_flight(2, 0, 4, 2)
    # stage 0: F(0,0) F(0,1) F(1,0) F(1,1) F(0,2) B(1,0) F(0,3): 4 x 10 + 1 alive
    assert peak_live_bytes(2, 0, 4, 2, [10.0, 1.0]) == 41.0


def test_stage_chunks_interleave_the_model():
    assert stage_chunks(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert stage_chunks(8, 2) == [[range(0, 4)], [range(4, 8)]]
    assert [[len(r) for r in c] for c in stage_chunks(10, 2, 2, edge_stage_layers=2)] == \
        [[2, 3], [3, 2]]


@pytest.mark.parametrize("overrides,key", [
    (["pp=1", "parallel.virtual_stages=2"], "parallel.virtual_stages"),
    (["pp=2", "parallel.virtual_stages=0"], "parallel.virtual_stages"),
    (["pp=2", "parallel.virtual_stages=2", "model.n_layer=3"], "parallel.virtual_stages"),
    (["pp=2", "parallel.virtual_stages=2", "train.global_batch_size=4"],
     "train.global_batch_size"),  # m = 1 < pp
    (["pp=2", "parallel.virtual_stages=2", "model.n_layer=4",
      "parallel.edge_stage_layers=2"], "parallel.edge_stage_layers"),
])
def test_virtual_stages_refused_before_launch(overrides, key):
    cfg = load_config(["device=cpu", "model=tiny", "train.micro_batch_size=4",
                       "train.global_batch_size=16", *overrides])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, 2 if "pp=2" in overrides else 1)


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
    assert trace.busy == 3.0 and 1 - trace.busy / trace.wall == 0.5
    assert expected_bubble(4, 4) == pytest.approx(3 / 7)
